"""Weight publication from the trainer to two inference replicas, against a memcpy of the same bytes.

    python benchmarks/weights.py --json                 # Qwen2.5-0.5B-shaped, bfloat16 (988 MB)
    python benchmarks/weights.py --json --layers 4      # a smaller one (a quick look)

The model: Qwen2.5-0.5B's parameter listing (Qwen2Config: hidden 896, 24 layers, MLP 4864, 14 heads with
2 KV heads, vocabulary 151936, tied embeddings), built on the meta device, its tensors materialised with
random values in the published dtype. The trainer (this process) is rank 0 of a real weight group
(`meshrl.runtime.weights.WeightGroup`); two receiver processes are ranks 1 and 2, each holding its own
copy of the model's tensors and loading every publication as the HF engine does (a tensor of the
parameter's dtype is kept as the parameter: no copy). Two transports, in the same invocation: shared
memory (the CPU path when every replica shares the trainer's host; the trainer fills the next slot's
segment bucket by bucket while the receivers take the buckets already in, as views) and the gloo
broadcast (the path between hosts, NCCL's on GPU), in buckets of
`--bucket-mb` (the trainer's default, 64).

One publication is timed from the trainer's `post` (the copy into the segment, or the first bucket) to
the end of `finish` (every replica has loaded the version and passed the barrier). Each version changes
every tensor, and after each one both receivers check what they loaded against checksums the trainer
computed (outside the timing): a mismatch fails the run. memcpy: the same tensors copied once, on one
thread, into preallocated ones. Medians of 5 publications and of 5 copies, after 3 warm-ups (one per
shared-memory slot: a slot's first fill allocates its pages, and each receiver maps it once).

Keys: shm_gb_per_s, broadcast_gb_per_s, memcpy_gb_per_s (bytes / median time), publish_s (median, shared
memory), publish_s_broadcast, shm_over_memcpy, broadcast_over_memcpy, gigabytes, tensors, verified.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import tempfile
import time

import torch

REPS, WARMUP = 5, 3


def manifest(layers: int, dtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen2.5-0.5B's parameters as the trainer lists them (names, shapes), in `dtype`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(n, tuple(p.shape), dtype) for n, p in model.named_parameters()]


def checksum(tensors: list[torch.Tensor]) -> int:
    """A sum over every 16-bit word of the tensors (exact, order-free)."""
    return sum(int(t.reshape(-1).view(torch.int16).sum()) for t in tensors)


def fill(tensors: list[torch.Tensor], version: int) -> None:
    """Change every tensor for `version` (a different value at the front of each, so nothing matches
    the previous version by chance)."""
    for i, t in enumerate(tensors):
        t.reshape(-1)[: 1 + i % 7].fill_(float(version % 97) / 7.0 + i % 3)


def receiver(port: int, rank: int, man: list, out: mp.Queue) -> None:
    from meshrl.runtime.weights import WeightGroup

    torch.set_num_threads(1)
    dtype = getattr(torch, man[0][2])
    mine = {name: torch.empty(shape, dtype=dtype) for name, shape, _ in man}
    group = WeightGroup("127.0.0.1", port, rank, 3, timeout_s=600)

    def apply(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:  # as the HF engine loads weights (`HFEngine.load_weights`)
            if tensor.dtype == mine[name].dtype:
                mine[name] = tensor
            else:
                mine[name].copy_(tensor)

    while (header := group.wait())["version"] >= 0:
        group.receive(header, apply)
        out.put((rank, int(header["version"]), checksum(list(mine.values()))))
    out.put((rank, -1, 0))


def publish(man: list, tensors: list[torch.Tensor], shm_dir: str | None, bucket_mb: int) -> list[float]:
    """Seconds per publication to two receiver processes, each version verified on arrival."""
    from meshrl.runtime.weights import WeightGroup

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=receiver, args=(port, r, man, out)) for r in (1, 2)]
    for p in procs:
        p.start()
    shm = (shm_dir, "meshrl-bench-weights") if shm_dir is not None else None
    group = WeightGroup("127.0.0.1", port, 0, 3, timeout_s=600, shm=shm)
    times = []
    try:
        for version in range(1, WARMUP + REPS + 1):
            fill(tensors, version)
            want = checksum(tensors)
            t0 = time.perf_counter()
            group.post(version, man, tensors, bucket_bytes=bucket_mb << 20)
            group.finish()
            dt = time.perf_counter() - t0
            got = sorted(out.get(timeout=600) for _ in procs)
            if got != [(1, version, want), (2, version, want)]:
                raise AssertionError(f"version {version}: receivers loaded {got}, the trainer sent {want}")
            if version > WARMUP:
                times.append(dt)
        group.close()
        assert sorted(out.get(timeout=600)[1] for _ in procs) == [-1, -1]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return times


def memcpy(tensors: list[torch.Tensor]) -> list[float]:
    torch.set_num_threads(1)
    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for rep in range(WARMUP + REPS):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors, strict=True):
            d.copy_(s)
        if rep >= WARMUP:
            times.append(time.perf_counter() - t0)
    if checksum(dst) != checksum(tensors):
        raise AssertionError("memcpy: the copy differs")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=24, help="Qwen2.5-0.5B has 24")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bucket-mb", type=int, default=64, help="trainer.bucket_mb (its default: 64)")
    args = ap.parse_args()
    man = manifest(args.layers, args.dtype)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g).to(getattr(torch, args.dtype)) for _, shape, _ in man]
    total = sum(t.numel() * t.element_size() for t in tensors)
    copy = statistics.median(memcpy(tensors))
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        shm = statistics.median(publish(man, tensors, shm_dir, args.bucket_mb))
    broadcast = statistics.median(publish(man, tensors, None, args.bucket_mb))
    result = {
        "shm_gb_per_s": round(total / shm / 1e9, 3),
        "broadcast_gb_per_s": round(total / broadcast / 1e9, 3),
        "memcpy_gb_per_s": round(total / copy / 1e9, 3),
        "publish_s": round(shm, 3),
        "publish_s_broadcast": round(broadcast, 3),
        "shm_over_memcpy": round(copy / shm, 3),
        "broadcast_over_memcpy": round(copy / broadcast, 3),
        "gigabytes": round(total / 1e9, 3),
        "tensors": len(man),
        "receivers": 2,
        "verified": True,  # every version was checked on both receivers; a mismatch raises before this
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
