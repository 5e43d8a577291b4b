"""The services of a run, one package per role; each has a light `config.py` and a `service.py`.

Partitions shared by the GRPO/PPO roles:
- `samples`: one row per completion. Rollout writes `prompt`; inference adds `response`, `logprobs`,
  `version`, `gen_s`, `gen_batch`; rollout adds `reward`, `advantage`, `valid`; optional roles add more
  (`ref_logprobs`, `values`, ...). The trainer claims whole groups that have every column it needs.
- `eval`: the same flow for held-out prompts (greedy and sampled accuracy).
- `gate`: the trainer writes (step, version) after each step; rollout paces itself on it.
"""

SAMPLES = "samples"
EVAL = "eval"
GATE = "gate"
