"""Half of a batch on each of two gloo ranks (FSDP2): the gradients the optimizer step sees, gathered.

python two_ranks.py MODEL OUT PORT LORA_RANK   (run by test_fsdp_ranks.py)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, model: str, out: str, port: int, lora_rank: int) -> None:
    from meshrl.engines.settings import LoraConfig
    from tests.unit.engines.test_fsdp_engine import Step, engine_with, update_grads, varied

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine = engine_with(model, micro_batch=2, lora=LoraConfig(rank=lora_rank) if lora_rank else None)
    whole = varied()
    stats, grads = update_grads(engine, whole.rows(torch.arange(rank, len(whole.mask), 2)), Step())
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    published = [t.clone() for t in engine.get_weights()]
    if rank == 0:
        torch.save({"stats": stats, "grads": full, "published": published}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    model, out, port, lora_rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    mp.spawn(rank_main, args=(model, out, port, lora_rank), nprocs=2)
