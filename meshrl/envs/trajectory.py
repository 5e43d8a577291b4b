"""A trajectory as tokens: what is trained is exactly what was generated.

The first context is the sample's prompt; after it, the model's turns (ids and behaviour logprobs as
inference wrote them, mask 1, the weight version that generated each token) alternate with the
environment's replies (ids as the chat template renders them, mask 0, logprob 0, version -1). The
trainer masks its loss with `loss_mask`, so environment tokens get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshrl.schema import LOGPROBS, LOSS_MASK, PROMPT, RESPONSE, TOKEN_VERSIONS


@dataclass
class Trajectory:
    ids: list[int]
    prompt_len: int
    mask: list[int] = field(default_factory=list)
    """Per token after the prompt: 1 = the model's, 0 = the environment's."""
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    gen_s: float = 0.0

    @classmethod
    def start(cls, prompt: list[int]) -> Trajectory:
        return cls(ids=list(prompt), prompt_len=len(prompt))

    def add_model(self, ids: list[int], logprobs: list[float], version: int) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"a turn of {len(ids)} tokens came with {len(logprobs)} logprobs")
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += [version] * len(ids)
        self.turns += 1

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    @property
    def version_range(self) -> tuple[int, int]:
        """[first, last] weight version of the model's tokens ((-1, -1) before any)."""
        mine = [v for v in self.versions if v >= 0]
        return (min(mine), max(mine)) if mine else (-1, -1)

    def sample(self) -> dict[str, list[int] | list[float]]:
        """The columns of the trained sample (one row), as lists: prompt and response ids, behaviour
        logprobs, loss mask and weight versions of the response's tokens."""
        return {
            PROMPT: self.ids[: self.prompt_len],
            RESPONSE: self.ids[self.prompt_len :],
            LOGPROBS: self.logprobs,
            LOSS_MASK: self.mask,
            TOKEN_VERSIONS: self.versions,
        }
