"""On-policy distillation on single-digit addition: a weak student learns from a strong teacher's scores
of the student's own samples.

    make run                                                          # runs/arith-base, runs/arith-sft
    meshrl sft --model runs/arith-base --data runs/arith-sft.jsonl --out runs/arith-teacher --steps 200 \
      --batch 40 --eval-fraction 0 memory.micro_batch=40 optim.lr=3e-3 optim.warmup_steps=10   # ~100%
    meshrl run recipes/opd_arith.py

recipes/grpo_arith.py plus one service: the teacher (a frozen model, here the tiny model after a longer
supervised run) reads every completion and writes, for each response token, its top-k next tokens and
their log-probabilities (`teacher_topk_ids`, `teacher_topk_logprobs`) and the logprob of the sampled
token (`teacher_logprobs`). The trainer's claim lists those columns, so it only ever sees scored rows;
its loss adds forward-KL(teacher top-k || student) at every response token to the policy gradient on
the task reward. Inference, rollout and the launcher do not know the teacher is there.

Variants by override: `trainer.loss.pg_coef=0` (distillation only); `trainer.distill.coef=0
trainer.distill.advantage=1` (the reverse-KL variant: teacher logprob - student logprob of each sampled
token as a dense per-token advantage).
"""

import dataclasses

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.teacher.config import TeacherConfig

TEACHER = "runs/arith-teacher"  # see above; override with teacher.model=PATH (after *.model=...)


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(["trainer.distill.coef=1.0"])
    teacher = ServiceGroup(
        id="teacher",
        config=TeacherConfig(model=TEACHER, top_k=8, threads=1),
        devices_per_replica=1,
    )
    return dataclasses.replace(base, name="opd_arith", groups=(*base.groups, teacher))
