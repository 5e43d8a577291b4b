"""Half of a batch on each of two gloo ranks (FSDP2): the gradients the optimizer step sees, gathered.

python two_ranks.py MODEL OUT PORT LORA_RANK [BATCH]   (run by test_fsdp_ranks.py; BATCH: varied or groups)
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, model: str, out: str, port: int, lora_rank: int, batch: str) -> None:
    from meshrl.engines.settings import LoraConfig
    from meshrl.engines.shared_prompts import plan
    from tests.unit.engines.test_fsdp_engine import Step, engine_with, update_grads, varied
    from tests.unit.engines.test_shared_prompts import groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine = engine_with(model, micro_batch=2, lora=LoraConfig(rank=lora_rank) if lora_rank else None)
    whole = groups(size=4) if batch == "groups" else varied()  # groups: each rank gets 2 rows of each
    mine = whole.rows(torch.arange(rank, len(whole.mask), 2))
    if batch == "groups":  # every micro-batch runs its prompt once
        assert all(plan(mb) is not None for mb in engine._micro_batches(mine))
    stats, grads = update_grads(engine, mine, Step())
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    published = [t.clone() for t in engine.get_weights()]
    if rank == 0:
        torch.save({"stats": stats, "grads": full, "published": published}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    model, out, port, lora_rank = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    batch = sys.argv[5] if len(sys.argv) > 5 else "varied"
    mp.spawn(rank_main, args=(model, out, port, lora_rank, batch), nprocs=2)
