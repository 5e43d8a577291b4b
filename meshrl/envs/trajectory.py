"""A trajectory as tokens, from the model calls that made it: what is trained is exactly what was
generated. One format for every agent (an environment's turns, a program's calls, a verifiers episode).

A trajectory is one or more segments, each a token sequence the model saw: a call's prompt, its
completion, then the next call's prompt when it extends that (the completion exactly as generated,
then the new messages' tokens), its completion, and so on. A call whose prompt does not extend the
segment (its history was rewritten: by the agent, or by a chat template that drops earlier reasoning)
starts a new segment. Per token after the first prompt: the loss mask (1 on the model's completions,
0 on everything else), the behaviour log-prob (0 elsewhere) and the weight version that generated it
(-1 elsewhere). The segments share the trajectory's reward and train as separate sequences of one
sample (positions restart, no attention across: meshrl/engines/packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from meshrl.schema import LOGPROBS, LOSS_MASK, PROMPT, RESPONSE, SEGMENTS, TOKEN_VERSIONS


@dataclass(frozen=True)
class Call:
    """One model call as inference answered it."""

    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    version: int
    """The weight version that generated the completion (its first, if a weight update interrupted it)."""
    images: tuple[str, ...] = ()
    """The images of the prompt (data URLs), in order."""


@dataclass
class Trajectory:
    ids: list[int] = field(default_factory=list)
    """Every segment's tokens, in order."""
    prompt_len: int = 0
    """The first prompt's length: the sample's prompt; everything after it is its response."""
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    """The segments' lengths over `ids`."""
    calls: int = 0
    splits: int = 0
    """Prompts that did not extend their segment (each started one)."""
    images: list[str] = field(default_factory=list)
    """A vision-language model's: the images (data URLs) whose placeholder tokens `ids` hold, in order."""
    image_segments: list[int] = field(default_factory=list)
    """How many of them each segment holds."""

    @property
    def tail(self) -> list[int]:
        """The current segment's tokens: what the next prompt extends."""
        return self.ids[len(self.ids) - self.segments[-1] :] if self.segments else []

    @property
    def tail_images(self) -> list[str]:
        """The images of the current segment."""
        return self.images[len(self.images) - self.image_segments[-1] :] if self.image_segments else []

    def prompt(self, ids: Sequence[int], images: Sequence[str] = ()) -> None:
        """The next call's prompt (and the images its placeholders stand for, all of them): the segment
        goes on with its new tokens when it extends the segment, else it is a new segment."""
        ids, images = list(ids), list(images)
        tail = self.tail
        if not self.ids:
            self.ids, self.prompt_len, self.segments = ids, len(ids), [len(ids)]
            self.images, self.image_segments = images, [len(images)]
        elif len(ids) >= len(tail) and ids[: len(tail)] == tail:
            self._add(ids[len(tail) :], trained=False)
            self.images += images[self.image_segments[-1] :]
            self.image_segments[-1] = len(images)
        else:
            self.splits += 1
            self.segments.append(0)
            self._add(ids, trained=False)
            self.images += images
            self.image_segments.append(len(images))

    def answer(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """The completion of the last prompt, as generated."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a completion of {len(ids)} tokens came with {len(logprobs)} log-probs")
        self._add(ids, trained=True, logprobs=logprobs, version=version)
        self.calls += 1

    def add(self, call: Call) -> None:
        self.prompt(call.prompt, call.images)
        self.answer(call.completion, call.logprobs, call.version)

    def _add(
        self, ids: Sequence[int], trained: bool, logprobs: Sequence[float] = (), version: int = -1
    ) -> None:
        self.ids += ids
        self.mask += [int(trained)] * len(ids)
        self.logprobs += logprobs if trained else [0.0] * len(ids)
        self.versions += [version if trained else -1] * len(ids)
        self.segments[-1] += len(ids)

    @property
    def version_range(self) -> tuple[int, int]:
        """[first, last] weight version of the model's tokens ((-1, -1) before any)."""
        mine = [v for v in self.versions if v >= 0]
        return (min(mine), max(mine)) if mine else (-1, -1)

    def sample(self, stop: int) -> dict[str, list[int] | list[float]]:
        """The trained sample's columns, as lists; a trajectory that ended before any answer gets one
        masked `stop` token after its prompt, so its (failed) row still has a response."""
        if not self.ids:
            self.prompt([stop])
        if len(self.ids) == self.prompt_len:
            self._add([stop], trained=False)
        return {
            PROMPT: self.ids[: self.prompt_len],
            RESPONSE: self.ids[self.prompt_len :],
            LOGPROBS: self.logprobs,
            LOSS_MASK: self.mask,
            TOKEN_VERSIONS: self.versions,
            SEGMENTS: self.segments,
        }


def join(calls: Sequence[Call]) -> Trajectory:
    """The calls of one session, in the order they were answered, as one trajectory."""
    out = Trajectory()
    for call in calls:
        out.add(call)
    return out
