"""Metrics by name: every metric a service reports is listed here once, with how values of it combine.

- `CATALOGUE` names each metric, how several values of it combine (mean, sum, max or standard
  deviation) and what it means. A name with `{teacher}` stands for one per teacher column prefix, `{function}` for one per reward
  function.
- `Metrics` collects values by name (numbers, or tensors of per-sample values) and reduces them: on one
  process, and across the ranks of a process group by key, with one all-reduce per kind of reduction.
  The trainer reduces each step's per-sample summaries and its mini-batches' update statistics; the
  critic its versions' updates; rollout its evaluations.
- `Sink` is where a row of reduced metrics goes: `JsonlSink` (the run directory's metrics.jsonl,
  critic.jsonl, eval.jsonl) today; experiment trackers plug in as further sinks.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch


class Reduce(enum.Enum):
    MEAN = "mean"
    """Mean of every value added (a tensor adds each element), over ranks too."""
    SUM = "sum"
    MAX = "max"
    STD = "std"
    """Population standard deviation of every value added."""


@dataclass(frozen=True)
class Metric:
    reduce: Reduce
    doc: str


M, S, X, D = Reduce.MEAN, Reduce.SUM, Reduce.MAX, Reduce.STD

CATALOGUE: dict[str, Metric] = {
    # the trainer's step (metrics.jsonl): samples
    "samples": Metric(S, "samples in the step"),
    "reward_mean": Metric(M, "mean reward of the step's trained samples"),
    "reward_std": Metric(D, "standard deviation of those rewards"),
    "advantage_mean": Metric(
        M, "mean advantage of the trained samples (per-token advantages: their row means)"
    ),
    "advantage_std": Metric(D, "standard deviation of those advantages"),
    "advantage_absmax": Metric(X, "largest absolute advantage"),
    "response_len_mean": Metric(M, "mean response length in tokens"),
    "response_len_max": Metric(X, "longest response"),
    "failed": Metric(S, "samples whose reward could not be computed (excluded from the loss)"),
    "staleness_mean": Metric(M, "weight versions between a sample's first token and the update on it"),
    "staleness_max": Metric(X, "largest such staleness"),
    "dropped_stale": Metric(S, "samples dropped for exceeding max_staleness"),
    "no_signal_fraction": Metric(M, "share of samples in groups whose rewards all agree"),
    "continued": Metric(S, "samples generated across a weight update (interrupt=continue)"),
    "agent/turns_mean": Metric(M, "model turns (calls) per agent trajectory"),
    "agent/turns_max": Metric(X, "most model turns of a trajectory"),
    "agent/sequences_mean": Metric(
        M, "token sequences per agent program's sample (segments: 1 = all joined)"
    ),
    "agent/truncated_turns": Metric(S, "trajectories cut at the environment's turn limit (env.max_turns)"),
    "agent/truncated_tokens": Metric(
        S, "trajectories cut at the environment's token budget (env.max_tokens)"
    ),
    "agent/generate_s_mean": Metric(M, "seconds an agent trajectory spent generating (its turns' batches)"),
    "agent/tool_calls_mean": Metric(M, "tool calls per environment trajectory (malformed ones included)"),
    "agent/tool_errors/{kind}": Metric(
        S, "tool calls that failed, by kind: malformed, unknown_tool, arguments, raised, timeout"
    ),
    "agent/env_s_mean": Metric(M, "seconds an environment trajectory spent in reset, step and reward"),
    "agent/queued_s_mean": Metric(
        M, "seconds an environment trajectory waited (for a generation slot, an env slot, the data plane)"
    ),
    # the policy update (the engine's statistics, averaged over a step's mini-batches)
    "loss": Metric(M, "the policy's whole loss"),
    "pg_loss": Metric(M, "policy-gradient term"),
    "entropy": Metric(M, "entropy of the policy at response tokens"),
    "kl_ref": Metric(M, "KL to the reference policy (its estimator: trainer.kl.estimator)"),
    "kl_coef": Metric(M, "coefficient of the KL term (adaptive with kl_target)"),
    "kl_behaviour": Metric(M, "k3 KL from the behaviour policy (inference) to the trained one"),
    "clip_fraction": Metric(M, "share of tokens whose ratio was clipped"),
    "approx_kl": Metric(M, "approximate KL between the policy before and after"),
    "ratio_max": Metric(X, "largest importance ratio"),
    "is_weight_mean": Metric(M, "mean truncated importance weight (off_policy decoupled / tis)"),
    "is_weight_max": Metric(X, "largest importance weight before truncation"),
    "is_truncated_fraction": Metric(M, "share of tokens whose importance weight was truncated"),
    "grad_norm": Metric(M, "global gradient norm before clipping"),
    "lr": Metric(M, "learning rate"),
    "nan_skipped": Metric(S, "updates skipped for a non-finite loss or gradient"),
    "distill_loss": Metric(M, "forward KL to the teachers' top-k, weighted"),
    "{teacher}_kl": Metric(M, "forward KL from a teacher's top-k to the student"),
    "{teacher}_agreement": Metric(M, "share of tokens where the student's top token is the teacher's"),
    "{teacher}_reverse_kl": Metric(M, "log p_student - log p_teacher of the sampled tokens"),
    # a mixture of experts (meshrl/engines/experts.py): the routing of the policy forwards' tokens
    "moe/aux_loss": Metric(
        M, "the routers' load-balancing loss (1: even; in the loss with trainer.moe.aux_loss_coef)"
    ),
    "moe/tokens_per_expert/{expert}": Metric(
        S, "tokens routed to an expert (from 0) in the step's forwards, summed over the MoE layers"
    ),
    "moe/load_max_over_mean": Metric(
        M, "tokens of a layer's busiest expert over its experts' mean (1: even), averaged over the MoE layers"
    ),
    "moe/load_max_over_mean_max": Metric(X, "the same at the most imbalanced MoE layer"),
    # values (the critic's versions, critic.jsonl; or the trainer's value head)
    "value_loss": Metric(M, "clipped value loss"),
    "value_clip_fraction": Metric(M, "share of tokens whose value update was clipped"),
    "values_mean": Metric(M, "mean value at response tokens"),
    "explained_variance": Metric(M, "share of the returns' variance the values explain"),
    "returns_mean": Metric(M, "mean return"),
    "valued": Metric(S, "samples the critic has computed values for"),
    # time (seconds) and throughput
    "time/step_s": Metric(M, "wall time of the step (metrics.jsonl: since the line before)"),
    "time/generate_s": Metric(X, "generation time of the step's samples (inference batches, once each)"),
    "time/train_s": Metric(M, "time in the step's updates, the loader's waits excluded"),
    "time/forward_backward_s": Metric(S, "forward and backward passes"),
    "time/optimizer_s": Metric(S, "optimizer steps"),
    "time/sync_s": Metric(M, "the publication that opened the step, on the training thread"),
    "time/publish_s": Metric(M, "the previous publication's broadcast and wait, on its own thread"),
    "time/wait_s": Metric(M, "waiting for the step's data"),
    "time/ring_s": Metric(M, "waiting for the devices (a colocation ring)"),
    "overhead_fraction": Metric(M, "share of the step outside generation, forward/backward and optimizer"),
    "samples_per_s": Metric(M, "samples trained per second of the step"),
    "generate_tokens_per_s": Metric(
        M, "inference's throughput: the step's response tokens per second of its generation batches"
    ),
    # evaluation (rollout, eval.jsonl)
    "greedy_reward": Metric(M, "mean reward of greedy completions of the held-out prompts"),
    "sampled_reward": Metric(M, "mean reward of sampled completions of the held-out prompts"),
    "greedy_accuracy": Metric(
        M, "share of greedy completions the correctness check accepts (rollout.correctness)"
    ),
    "sampled_accuracy": Metric(M, "share of sampled completions the correctness check accepts"),
    "sampled_answers": Metric(S, "sampled completions the correctness check scored (sampled_accuracy's n)"),
    "sampled_stderr": Metric(M, "binomial standard error of sampled_accuracy: sqrt(p (1 - p) / n)"),
    "pass@{k}": Metric(M, "share of held-out prompts with at least one correct completion of k sampled"),
    "prompts": Metric(S, "held-out prompts evaluated"),
    # reward functions (rollout: rewards.jsonl per step's worth of scored samples, and eval.jsonl)
    "reward/{function}": Metric(
        M, "mean value of one reward function over the samples it applied to (None: not applicable)"
    ),
}

_FAMILIES = [
    (re.compile("^" + re.sub(r"\\\{[a-z]+\\\}", "[A-Za-z0-9_]+", re.escape(name)) + "$"), metric)
    for name, metric in CATALOGUE.items()
    if "{" in name
]


def lookup(name: str) -> Metric:
    """The catalogue's entry for `name` (a family's, for a per-teacher name)."""
    metric = CATALOGUE.get(name)
    if metric is not None:
        return metric
    for pattern, family in _FAMILIES:
        if pattern.match(name):
            return family
    raise KeyError(f"metric {name!r} is not in meshrl/observe/metrics.py's CATALOGUE; add it there")


class Metrics:
    """Values by name, reduced as the catalogue says. Every rank of a group must add the same names."""

    def __init__(self) -> None:
        self.acc: dict[str, list[float]] = {}  # name -> [sum, sum of squares, count] or [max]

    def add(self, name: str, value: float | torch.Tensor) -> None:
        """A value of `name`; a tensor adds each of its elements."""
        kind = lookup(name).reduce
        if kind is Reduce.MAX:
            top = (
                (float(value.max()) if value.numel() else -math.inf)
                if isinstance(value, torch.Tensor)
                else value
            )
            self.acc[name] = [max(self.acc.get(name, [-math.inf])[0], float(top))]
            return
        total, squares, count = self.acc.setdefault(name, [0.0, 0.0, 0.0])
        if isinstance(value, torch.Tensor):
            x = value.double()
            total += float(x.sum())
            squares += float((x**2).sum()) if kind is Reduce.STD else 0.0
            count += x.numel()
        else:
            total += value
            squares += value * value if kind is Reduce.STD else 0.0
            count += 1
        self.acc[name] = [total, squares, count]

    def add_all(self, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.add(name, value)

    def reduce(self, group: Any = None) -> dict[str, float]:
        """The reduced value of every name, over the ranks of torch.distributed `group` when given
        (a collective: every rank calls it)."""
        names = sorted(self.acc)
        if group is not None:
            self._all_reduce(names, group)
        return {name: self._value(name) for name in names}

    def _all_reduce(self, names: list[str], group: Any) -> None:
        import torch.distributed as dist

        summed = [n for n in names if lookup(n).reduce is not Reduce.MAX]
        maxed = [n for n in names if lookup(n).reduce is Reduce.MAX]
        sums = torch.tensor([x for n in summed for x in self.acc[n]], dtype=torch.float64)
        tops = torch.tensor([self.acc[n][0] for n in maxed], dtype=torch.float64)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(tops, op=dist.ReduceOp.MAX, group=group)
        for k, n in enumerate(summed):
            self.acc[n] = sums[3 * k : 3 * k + 3].tolist()
        for k, n in enumerate(maxed):
            self.acc[n] = [float(tops[k])]

    def _value(self, name: str) -> float:
        kind, acc = lookup(name).reduce, self.acc[name]
        if kind is Reduce.MAX:
            return acc[0] if math.isfinite(acc[0]) else 0.0
        total, squares, count = acc
        if kind is Reduce.SUM:
            return total
        mean = total / max(count, 1)
        if kind is Reduce.MEAN:
            return mean
        return math.sqrt(max(squares / max(count, 1) - mean**2, 0.0))


def merged(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Rows of metrics (a mini-batch's, an epoch's) combined name by name as the catalogue says."""
    m = Metrics()
    for row in rows:
        m.add_all(row)
    return m.reduce()


# -------------------------------------------------------------------------------------------------------
# sinks


class Sink(Protocol):
    """Where rows of metrics go (a row: the step axis and reduced metrics)."""

    def write(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, appended; `keep` lines of an earlier run survive (a resumed run cuts
    the file back to its checkpoint; a fresh run to nothing)."""

    def __init__(self, path: Path, *, keep: int | None = 0) -> None:
        from meshrl.state.checkpoint import truncate_jsonl

        self.path = path
        self.lines = 0
        if keep == 0:
            path.write_text("")
        elif keep is not None:
            truncate_jsonl(path, keep)
            self.lines = keep

    def write(self, row: Mapping[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.lines += 1

    def close(self) -> None:
        pass
