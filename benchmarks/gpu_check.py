"""The trainer at a real model size on one GPU, through meshrl's own services: bf16-mixed, activation
checkpointing and token-budget packing on a random-init model of Qwen2.5-0.5B's shape, vLLM generating
beside it on the same GPU with every version's weights arriving from the trainer.

    bash benchmarks/gpu_check.sh                  # one GPU, about 5 minutes; prints one JSON object
    python benchmarks/gpu_check.py --steps 8 --json

What runs: `meshrl run recipes/grpo_arith.py --devices 0,0` - inference and the trainer are two device
slots on GPU 0 (vLLM takes `--vllm-memory` of the GPU's memory, the trainer what is left), the trainer
in bf16-mixed with activation checkpointing and `--tokens-per-micro-batch`, one mini-batch a step (so
every forward of a step runs on the weights inference sampled with), publishing each version in bf16
through shared memory to vLLM's worker, the trainer's process group on NCCL. The model is built here
from Qwen2.5-0.5B's config (nothing downloaded), with a character tokenizer padded to its vocabulary so
that every sampled id decodes; the reward is a coin flip per completion text (`coin`), so the
advantages, gradients and weight updates are real although nothing is learnt.

Figures (the JSON keys):
- gpu, engine ("vllm"; "hf" where vLLM is not installed, and `note` says so), steps, startup_s, wall_s;
- train_tokens_per_s: response tokens trained per second of forward/backward + optimizer time, and
  generate_tokens_per_s: inference's response tokens per second of generation (medians after warm-up);
- kl_behaviour_first: the k3 KL between the logprobs inference sampled with and the trainer's at the
  first step (both from the checkpoint's weights); kl_behaviour_synced: its median over the later steps
  (inference on weights the trainer published) - the trainer/inference logprob agreement, in bf16;
- median_step_s, and peak_gpu_mb: nvidia-smi's memory.used of the GPU, sampled every 0.5 s.

`--cpu` runs the same path on CPU with a small model of the same family and the HF engine (the suite's
test of this script); without it, and without a GPU, the script stops with a message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

START = time.time()
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SMALL = dict(  # --cpu: Qwen2's architecture at a size a CPU trains in seconds
    model_type="qwen2", vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
)  # fmt: skip


def coin(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """A reward that is a fair coin per completion text: real advantages, nothing to learn."""
    return [float(zlib.crc32(str(c).encode()) % 2) for c in completions]


def build(path: Path, spec: dict[str, Any]) -> None:
    """A random-init model of `spec` in bf16, with the character tokenizer padded to its vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from meshrl.models.tiny import build_tokenizer

    spec = dict(spec)
    tok = build_tokenizer(spec["vocab_size"])
    tok.model_max_length = spec["max_position_embeddings"]
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(path)
    tok.save_pretrained(path)


class GPUMemory(threading.Thread):
    """The GPU's memory.used (MiB), sampled every 0.5 s while the run lasts; its peak."""

    def __init__(self, gpu: int) -> None:
        super().__init__(daemon=True)
        self.gpu, self.peak, self.done = gpu, 0.0, threading.Event()

    def run(self) -> None:
        query = ["nvidia-smi", f"--id={self.gpu}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        while not self.done.wait(0.5):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
                self.peak = max(self.peak, float(out.strip().splitlines()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return


def overrides(args: argparse.Namespace, model: Path, run_dir: Path) -> list[str]:
    return [
        f"*.model={model}", f"run_dir={run_dir}", f"total_steps={args.steps}", "rollout.eval_every=0",
        f"prompts_per_step={args.prompts}", f"group_size={args.group_size}",
        json.dumps({"gpu_check:coin": 1.0}).join(("rollout.rewards=", "")),
        f"inference.engine={args.engine}", f"inference.max_new_tokens={args.max_new_tokens}",
        f"inference.max_batch={args.prompts * args.group_size}", 'inference.loader_kwargs={"dtype": "bfloat16"}',
        f"inference.vllm.gpu_memory_fraction={args.vllm_memory}",
        f"inference.vllm.max_model_len={args.max_new_tokens + 64}",
        "trainer.memory.precision=bf16-mixed", "trainer.memory.activation_checkpointing=true",
        f"trainer.memory.max_tokens_per_micro_batch={args.tokens_per_micro_batch}", "trainer.mini_batches=1",
        "trainer.optim.lr=1e-5", "trainer.optim.warmup_steps=0",
    ]  # fmt: skip


def check(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from trainer_memory import SHAPES

    model, run_dir = root / "model", root / "run"
    build(model, SMALL if args.cpu else SHAPES["qwen2.5-0.5b"])
    cmd = [sys.executable, "-m", "meshrl.cli", "run", str(REPO / "recipes" / "grpo_arith.py")]
    cmd += [] if args.cpu else ["--devices", f"{args.gpu},{args.gpu}"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE), os.environ.get("PYTHONPATH")))),
    }
    memory = GPUMemory(args.gpu)
    if not args.cpu:
        memory.start()
    t0 = time.time()
    proc = subprocess.Popen([*cmd, *overrides(args, model, run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=root)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=args.timeout - (time.time() - START))
    except subprocess.TimeoutExpired:
        proc.terminate()  # meshrl run stops every service of the run gracefully on SIGTERM
        out, err = proc.communicate()
    wall = time.time() - t0
    memory.done.set()
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: the run failed ({proc.returncode}):\n{err[-6000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    later = metrics[1:] or metrics
    steady = metrics[min(args.warmup, len(metrics) - 1) :]
    trained = [
        m["samples"] * m["response_len_mean"] / (m["time/forward_backward_s"] + m["time/optimizer_s"]) for m in steady
    ]  # fmt: skip
    ready = [line for line in out.splitlines() if "service processes ready in" in line]
    return {
        "gpu": gpu_name(args),
        "engine": args.engine,
        "steps": len(metrics),
        "train_tokens_per_s": round(statistics.median(trained), 1),
        "generate_tokens_per_s": round(statistics.median(m["generate_tokens_per_s"] for m in steady), 1),
        "kl_behaviour_first": metrics[0]["kl_behaviour"],
        "kl_behaviour_synced": statistics.median(m["kl_behaviour"] for m in later),
        "median_step_s": round(statistics.median(m["time/step_s"] for m in steady), 3),
        "peak_gpu_mb": round(memory.peak) if memory.peak else None,
        "startup_s": float(ready[0].split("ready in")[1].split("s")[0]) if ready else None,
        "wall_s": round(wall, 1),
        "grad_norm": round(statistics.median(m["grad_norm"] for m in metrics), 4),
        "response_len_mean": round(statistics.median(m["response_len_mean"] for m in steady), 1),
        "samples_per_step": metrics[0]["samples"],
        "settings": overrides(args, Path("MODEL"), Path("RUN"))[3:],
    }


def gpu_name(args: argparse.Namespace) -> str:
    import torch

    return "cpu" if args.cpu else torch.cuda.get_device_name(args.gpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--cpu", action="store_true", help="a small model on CPU with the HF engine (the tests)")
    p.add_argument("--gpu", type=int, default=0, help="the GPU both slots share")
    p.add_argument("--engine", default=None, help="inference engine (default: vllm if installed, else hf)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the throughput medians")
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--tokens-per-micro-batch", type=int, default=32768)
    p.add_argument("--keep", help="a directory to build the model and run in, kept (its logs: DIR/run/logs)")
    p.add_argument(
        "--timeout", type=float, default=3600, help="seconds for the whole check, start-up included"
    )
    p.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's share of the GPU's memory")
    args = p.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible (torch.cuda.is_available() is False); this check needs one GPU "
              "(--cpu runs its small CPU version)", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    note = None
    if args.engine is None:
        from meshrl.engines import vllm

        args.engine = "vllm" if vllm.available() and not args.cpu else "hf"
        if args.engine == "hf" and not args.cpu:
            note = f"vLLM is not installed ({vllm.INSTALL}): the HF engine generated"
    sys.path.insert(0, str(HERE))
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        report = check(args, Path(args.keep).resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="meshrl-gpu-check-") as tmp:
            report = check(args, Path(tmp))
    if note:
        report["note"] = note
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
