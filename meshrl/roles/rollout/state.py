"""What rollout carries over a restart, in one typed record.

A checkpoint saves it (`<checkpoint>/<process>.json`) and a resumed run loads it; a rollout process
restarted on its own re-joins from the same record, written to its state file ahead of every change
it makes in the data plane (see meshrl/state/statefile.py). One format, one `to_json` / `from_json`.

Nothing here is derived from something else in it: the dataset order of an epoch is rebuilt from the
seed and `epoch` (the same shuffles), so it is not saved.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EvalResult = tuple[bool, float, int, dict[str, float]]
"""An evaluation row's (greedy?, reward, prompt index, the value of each reward function that applied)."""


@dataclass
class RolloutState:
    # feeding
    epoch: int = 0
    """Passes over the training rows begun (the order of each is a shuffle seeded by the recipe)."""
    cursor: int = 0
    """Position in this epoch's order."""
    started: int = 0
    """Samples fed (rows with a prompt), less those dynamic sampling handed back."""
    skipped: int = 0
    """Prompts longer than max_prompt_len, passed over."""
    group_seq: int = 0
    """The last group id given out (replica k numbers from k * 10**12)."""
    refill: list[int] = field(default_factory=list)
    """min_version of each group dynamic sampling dropped: new prompts take their places in order."""
    # pacing
    gates: int = 0
    """Gate rows (published weight versions) counted."""
    last_gate: int = -1
    """Version of the last gate counted (a restarted process is handed it again)."""
    final_version: int | None = None
    # scoring
    scored: int = 0
    failed: int = 0
    """Samples whose reward function raised or returned a non-finite number."""
    filtered: int = 0
    """Samples of groups dynamic sampling dropped."""
    kl_coef: float = 0.0
    """The coefficient of the KL penalty in the reward (it adapts when kl_target is set)."""
    # evaluation
    eval_pending: dict[int, int] = field(default_factory=dict)
    """Version -> evaluation rows not back yet."""
    eval_results: dict[int, list[EvalResult]] = field(default_factory=dict)
    """Version -> (greedy?, reward, prompt index, each reward function's value) of the rows back so far."""
    eval_lines: int = 0
    """Lines of eval.jsonl when a checkpoint was taken (a resumed run cuts the file back to them)."""
    # effects in flight: what a successor must complete without counting it again
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Puts by idempotency key: {"kind": "feed", "groups": [...]} or {"kind": "eval", "version": v}."""
    replay: set[int] = field(default_factory=set)
    """Groups counted whose rows may come back unacknowledged: finish them, do not count them."""
    replay_eval: set[int] = field(default_factory=set)
    """Evaluation row ids likewise."""
    handling: set[int] = field(default_factory=set)
    """Groups being handled now (counted, not acknowledged yet): saved as part of `replay`."""
    handling_eval: set[int] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch, "cursor": self.cursor, "started": self.started, "skipped": self.skipped,
            "group_seq": self.group_seq, "refill": self.refill, "gates": self.gates, "last_gate": self.last_gate,
            "final_version": self.final_version, "scored": self.scored, "failed": self.failed,
            "filtered": self.filtered, "kl_coef": self.kl_coef,
            "eval_pending": {str(k): v for k, v in self.eval_pending.items()},
            "eval_results": {str(k): v for k, v in self.eval_results.items()},
            "eval_lines": self.eval_lines, "pending": self.pending,
            "replay": sorted(self.replay | self.handling), "replay_eval": sorted(self.replay_eval | self.handling_eval),
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RolloutState:
        plain = {
            k: v
            for k, v in data.items()
            if k not in ("eval_pending", "eval_results", "replay", "replay_eval")
        }
        return cls(
            **plain,
            eval_pending={int(k): v for k, v in data["eval_pending"].items()},
            eval_results={
                int(k): [(bool(g), float(r), int(p), dict(f)) for g, r, p, f in v]
                for k, v in data["eval_results"].items()
            },
            replay=set(data["replay"]),
            replay_eval=set(data["replay_eval"]),
        )
