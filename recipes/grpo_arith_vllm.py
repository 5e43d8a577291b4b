"""GRPO on arithmetic with vLLM generating: recipes/grpo_arith.py on the vLLM engine.

    pip install 'meshrl[vllm]' && pip uninstall -y torchvision torchaudio torchcodec   # or: make test-vllm
    meshrl run recipes/grpo_arith_vllm.py *.model=runs/arith-sft

vLLM's CPU build runs here; on a GPU machine the same recipe runs its CUDA build. vLLM's worker takes
each weight version from the trainer itself (shared memory on one host, else the weight group's
broadcast: NCCL on GPU), reloads it in place and resets the prefix cache.
"""

from grpo_arith import recipe as grpo_recipe

from meshrl.planning.recipe import Recipe


def recipe() -> Recipe:
    base = grpo_recipe().with_overrides(["inference.engine=vllm"])
    return base.with_overrides(["name=grpo_arith_vllm"])
