"""GRPO on arithmetic with vLLM generating: recipes/grpo_arith.py on the vLLM engine.

    pip install 'meshrl[vllm]' && pip uninstall -y torchvision torchaudio torchcodec   # or: make test-vllm
    meshrl run recipes/grpo_arith_vllm.py *.model=runs/arith-sft

vLLM's CPU build runs here; on a GPU machine the same recipe runs its CUDA build. The trainer publishes
weights exactly as to the HF engine; the engine reloads them in place and resets its prefix cache.
"""

from grpo_arith import recipe as grpo_recipe

from meshrl.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(["inference.engine=vllm"])
    return base.with_overrides(["name=grpo_arith_vllm"])
