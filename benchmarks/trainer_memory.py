"""Trainer memory and step time: one policy update at real model shapes, the plain engine against every
memory setting on.

    python benchmarks/trainer_memory.py --json
    python benchmarks/trainer_memory.py --shapes smollm2-135m --rows 16 --json

Builds random-init models with SmolLM2-135M's and Qwen2.5-0.5B's shapes from configs written here
(nothing downloaded), a batch per shape of rows with responses of uniform random length (so padding and
packing matter), and runs one `FSDPEngine.update_policy` per configuration, each in a fresh process
that reports its own RSS high-water mark (the model load included) and the update's wall time:

- baseline: fp32, no activation checkpointing, whole logits (logits_chunk 0), micro-batches of rows;
- fp32_all: activation checkpointing, chunked log-probs, token-budget micro-batches with packing;
- bf16_all: fp32_all in bf16-mixed precision (fp32 master weights and optimizer state);
- lora: bf16_all training LoRA adapters only (trainer.lora).

Per shape: peak_mb_baseline, peak_mb_all (bf16_all), memory_ratio (target <= 0.4), step_s_baseline,
step_s_fp32_all, time_ratio = step_s_fp32_all / step_s_baseline (target <= 1.3), step_s_bf16_all
(bf16 matmuls on a CPU without native bf16 support say little about a GPU), lora_peak_mb; and
peak_mb_fp32_all, cpu_s_baseline, cpu_s_fp32_all (the update's CPU seconds: on a machine shared with
other work, wall times of runs minutes apart are not comparable, CPU seconds less unfairly so).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(  # HuggingFaceTB/SmolLM2-135M's config.json
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu",
    ),
    "qwen2.5-0.5b": dict(  # Qwen/Qwen2.5-0.5B's config.json
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
    ),
}  # fmt: skip
ROWS = {"smollm2-135m": 8, "qwen2.5-0.5b": 4}
"""Rows per shape: the baseline's one micro-batch fits this machine's memory in about a minute."""

ALL: dict[str, Any] = dict(activation_checkpointing=True, logits_chunk=1024, max_tokens_per_micro_batch=2048)
CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": dict(precision="fp32", activation_checkpointing=False, logits_chunk=0),
    "fp32_all": dict(precision="fp32", **ALL),
    "bf16_all": dict(precision="bf16-mixed", **ALL),
    "lora": dict(precision="bf16-mixed", **ALL, lora=dict(rank=16, alpha=32.0)),
}


def build(shape: str, path: Path) -> None:
    """A random-init model of `shape`, saved in bfloat16 (the trainer loads it in float32)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)


def batch(rows: int, vocab: int, prompt: int, low: int, high: int) -> Any:
    import torch

    from meshrl.engines.packing import pack

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (rows,), generator=g)
    return pack(
        [torch.randint(0, vocab, (prompt,), generator=g) for _ in range(rows)],
        [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths],
        [-torch.rand(int(n), generator=g) for n in lengths],
        torch.randn(rows, generator=g),
        torch.ones(rows),
    )


def child(args: argparse.Namespace) -> None:
    """One configuration, one update, in this process: prints {"peak_mb", "step_s", "cpu_s"}."""
    import torch

    from meshrl.engines.fsdp import FSDPEngine
    from meshrl.engines.settings import LoraConfig, MemoryConfig, OptimConfig

    settings = dict(CONFIGS[args.child])
    lora = LoraConfig(**settings.pop("lora")) if "lora" in settings else None
    memory = MemoryConfig(micro_batch=args.rows, **settings)
    engine = FSDPEngine(
        args.model, OptimConfig(lr=1e-6), device=torch.device("cpu"), memory=memory, lora=lora
    )
    b = batch(args.rows, SHAPES[args.shape]["vocab_size"], args.prompt, args.min_response, args.max_response)
    t0, cpu0 = time.perf_counter(), _cpu_s()
    engine.update_policy(b)
    step_s, cpu_s = time.perf_counter() - t0, _cpu_s() - cpu0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"peak_mb": round(peak_mb, 1), "step_s": round(step_s, 2), "cpu_s": round(cpu_s, 2)}))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(args: argparse.Namespace, shape: str, model: Path, config: str) -> dict[str, float] | None:
    cmd = [sys.executable, __file__, "--child", config, "--shape", shape, "--model", str(model),
           "--rows", str(args.rows or ROWS[shape]), "--prompt", str(args.prompt),
           "--min-response", str(args.min_response), "--max-response", str(args.max_response)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{shape} {config} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--rows", type=int, default=0, help="rows per update (0: the shape's default)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--min-response", type=int, default=64)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="meshrl-trainer-memory-") as tmp:
        for shape in args.shapes.split(","):
            model = Path(tmp) / shape
            build(shape, model)
            runs = {c: measure(args, shape, model, c) for c in args.configs.split(",")}
            report[shape] = summary(runs, args.rows or ROWS[shape])
            if not args.json:
                print(shape, report[shape], flush=True)
    if args.json:
        print(json.dumps(report))


def summary(runs: dict[str, dict[str, float] | None], rows: int) -> dict[str, Any]:
    def get(config: str, key: str) -> float | None:
        run = runs.get(config)
        return None if run is None else run[key]

    base_mb, all_mb = get("baseline", "peak_mb"), get("bf16_all", "peak_mb")
    base_s, fp32_s = get("baseline", "step_s"), get("fp32_all", "step_s")
    return {
        "rows": rows,
        "peak_mb_baseline": base_mb,
        "peak_mb_all": all_mb,
        "memory_ratio": round(all_mb / base_mb, 3) if base_mb and all_mb else None,
        "step_s_baseline": base_s,
        "step_s_fp32_all": fp32_s,
        "time_ratio": round(fp32_s / base_s, 3) if base_s and fp32_s else None,
        "step_s_bf16_all": get("bf16_all", "step_s"),
        "peak_mb_fp32_all": get("fp32_all", "peak_mb"),
        "cpu_s_baseline": get("baseline", "cpu_s"),
        "cpu_s_fp32_all": get("fp32_all", "cpu_s"),
        "lora_peak_mb": get("lora", "peak_mb"),
    }


if __name__ == "__main__":
    main()
