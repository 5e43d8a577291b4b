"""Configuration of the inference service."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshrl.engines.settings import INSTALL, SGLangSettings, SimGeneration, VLLMSettings, installed
from meshrl.models.hub import missing
from meshrl.models.vision import disagreement, is_vision
from meshrl.planning.config import ServiceConfig
from meshrl.planning.wiring import Read, Write
from meshrl.schema import CALLS, EVAL, GENERATED, IMAGE_MASK, IMAGES, PICTURES, PROMPT, SAMPLES

if TYPE_CHECKING:
    from meshrl.planning.recipe import RunSettings, ServiceGroup
    from meshrl.planning.wiring import Wiring


@dataclass(frozen=True, kw_only=True)
class InferenceConfig(ServiceConfig):
    service = "meshrl.roles.inference.service:InferenceService"
    rejoins = True  # a restarted replica re-joins the weight group and gets the current version

    model: str
    """Local path of the initial policy (anything AutoModelForCausalLM.from_pretrained loads)."""
    loader_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to from_pretrained (dtype, trust_remote_code, gguf_file, ...)."""
    engine: Literal["hf", "vllm", "sglang", "sim"] = "hf"
    """Generation engine: "hf" (transformers; CPU, tests, small models), "vllm" (needs the vllm extra),
    "sglang" (GPU; needs the sglang extra) or "sim" (sleeps; benchmarks)."""
    sim: SimGeneration = SimGeneration()
    """Settings of the simulated engine."""
    vllm: VLLMSettings = VLLMSettings()
    """Settings of the vLLM engine."""
    sglang: SGLangSettings = SGLangSettings()
    """Settings of the SGLang engine."""
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    max_new_tokens: int = 16
    max_batch: int = 256
    """Rows generated together at most."""
    interrupt: Literal["finish", "continue"] = "finish"
    """When new weights arrive mid-batch: "finish" the batch on the old weights (the new ones are
    staged and swapped in after it), or "continue" (stop at the next token, load, continue the same
    completions on the new weights; such samples carry both versions)."""
    preempt: Literal["finish", "abort"] = "finish"
    """In a colocation ring, when an ON_DEMAND member asks for the devices mid-batch: "finish" the batch,
    then give them up; or "abort" (stop at the next token, drop the partial completions, give the devices
    up, and generate those rows again from the start once they are back)."""
    trainer: str = "trainer"
    """Group id of the trainer whose weights this replica follows."""
    threads: int = 0
    """torch threads of this process (0: leave the default)."""

    def validate(self) -> Iterator[str]:
        if self.max_new_tokens < 1:
            yield "max_new_tokens: must be >= 1"
        if self.max_batch < 1:
            yield "max_batch: must be >= 1"

    def reads(self) -> tuple[Read, ...]:
        # prompts to complete: agents' model calls where an agents group makes them, else rollout's samples;
        # a vision-language model's pixels, and for vLLM (it processes its own) the pictures
        images = (IMAGES, IMAGE_MASK, *((PICTURES,) if self.engine == "vllm" else ()))
        return (
            Read(
                "generate",
                (CALLS, SAMPLES),
                (PROMPT,),
                consumer="inference",
                optional=images,
            ),
            Read("evaluate", EVAL, (PROMPT,), consumer="inference", optional=images),
        )

    def writes(self) -> tuple[Write, ...]:
        return (Write("generated", (CALLS, SAMPLES), GENERATED), Write("evaluated", EVAL, GENERATED))

    def follows(self) -> str:
        return self.trainer

    def applies_adapters(self) -> bool:
        return self.engine == "vllm"

    def offers(self) -> dict[str, Any]:
        return {"turn_tokens": self.max_new_tokens}

    def check(self, run: RunSettings, group: ServiceGroup, wiring: Wiring) -> list[str]:
        problems = []
        if self.engine == "hf" and group.devices_per_replica > 1:
            problems.append("engine: the hf engine runs in one process; use devices_per_replica 0 or 1")
        if not Path(self.model).exists():
            problems.append(missing(self.model))
        elif wiring.claim("generate").partition == SAMPLES and (
            why := disagreement(self.model, wiring.claim("generate").columns)
        ):
            problems.append(why)
        if self.engine in ("vllm", "sglang"):
            name = "vLLM" if self.engine == "vllm" else "SGLang"
            if self.engine == "sglang" and Path(self.model).exists() and is_vision(self.model):
                problems.append(
                    f"engine: {self.model} is a vision-language model, whose images the SGLang engine does not "
                    "take yet; use the hf or vllm engine"
                )
            if not installed(self.engine):
                problems.append(
                    f"engine: {self.engine!r} needs {name}, which is not installed: {INSTALL[self.engine]}"
                )
            if (self.top_k or self.top_p < 1) and run.temperature > 0:
                problems.append(
                    f"engine: with top_k / top_p, {name}'s logprobs are renormalised over the kept tokens and "
                    "would not match the trainer's; use the hf engine or turn truncation off"
                )
        return problems

    def shares_devices(self) -> str | None:
        if self.engine == "vllm":
            return ("its engine is vllm, which cannot offload (its weights and KV cache would stay on the devices "
                    "through the other members' turns); use the hf engine in a ring or give the group devices of "
                    "its own")  # fmt: skip
        return None
