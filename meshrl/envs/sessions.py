"""A session's model calls as one trained sample (black-box agents: meshrl/roles/agents/service.py).

An agent program calls the model through the endpoint; each call is recorded as the prompt it was
rendered to and the tokens inference generated (with their log-probs and weight version). The calls of
one session become one trajectory:

- where a call's prompt starts with everything before it (the previous prompt and completion exactly as
  generated, which the endpoint arranges whenever the agent sends back the history it was given), the
  call joins the sequence: the prompt's new tokens (tool results, the user's next turn) are masked, the
  completion is trained;
- where it does not (the agent re-rendered, truncated or edited its history), a new segment starts. The
  segments of a trajectory share its reward and are trained as separate sequences of one sample (their
  positions restart; meshrl/engines/packing.py), and the split is counted.

Pure Python, no torch: the launcher plans agent recipes without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def session_token(replica: str, key: str, min_version: int) -> str:
    """The session part of the base URL an agents replica hands a program (`.../s/<token>/v1`): the
    replica running it (where its calls' rows go), the session's key, and the oldest weight version its
    calls may be generated with (the run's pacing)."""
    return f"{replica}~{key}~{min_version}"


def parse_token(token: str) -> tuple[str | None, int]:
    """(agents replica, min_version) of a session token; (None, 0) for a session the caller named."""
    parts = token.split("~")
    if len(parts) == 3 and parts[2].isdigit():
        return parts[0], int(parts[2])
    return None, 0


@dataclass(frozen=True)
class Record:
    """One model call as inference answered it."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    version: int
    """The weight version that generated the completion (its first, if a weight update interrupted it)."""


@dataclass
class Joined:
    """The sample of a session: the first prompt, then everything after it."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    """Lengths of the sample's sequences over prompt + response (one entry: a single sequence)."""
    splits: int = 0
    """Calls whose prompt did not extend what came before (each started a segment)."""

    def add(
        self, ids: Sequence[int], trained: bool, logprobs: Sequence[float] = (), version: int = -1
    ) -> None:
        self.response += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.logprobs += logprobs if trained else [0.0] * len(ids)
        self.versions += [version if trained else -1] * len(ids)
        self.segments[-1] += len(ids)

    @property
    def version_range(self) -> tuple[int, int]:
        mine = [v for v in self.versions if v >= 0]
        return (min(mine), max(mine)) if mine else (-1, -1)


def join(records: Sequence[Record]) -> Joined:
    """The calls of one session, in the order they were answered, as one sample."""
    if not records:
        raise ValueError("a session without model calls has no sample")
    first = records[0]
    out = Joined(prompt=list(first.prompt), segments=[len(first.prompt)])
    seq = list(first.prompt)  # the current segment's tokens so far
    for k, r in enumerate(records):
        if len(r.completion) != len(r.logprobs):
            raise ValueError(f"call {k}: {len(r.completion)} tokens came with {len(r.logprobs)} log-probs")
        if k > 0:
            if len(r.prompt) >= len(seq) and r.prompt[: len(seq)] == seq:
                out.add(r.prompt[len(seq) :], trained=False)
                seq = list(r.prompt)
            else:  # the history was rewritten: a sequence of its own
                out.splits += 1
                out.segments.append(0)
                out.add(r.prompt, trained=False)
                seq = list(r.prompt)
        out.add(r.completion, trained=True, logprobs=r.logprobs, version=r.version)
        seq += r.completion
    return out
