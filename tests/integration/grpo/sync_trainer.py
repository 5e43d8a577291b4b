"""Trainer side of the weight-sync test: update, publish, and print its own logprobs of a fixed sequence.

python sync_trainer.py MODEL WEIGHT_PORT DIST_PORT VERSIONS
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from meshrl.engines.fsdp import FSDPEngine
from meshrl.engines.optim import OptimConfig
from meshrl.engines.packing import pack
from meshrl.engines.settings import MemoryConfig
from meshrl.runtime.weights import WeightGroup

SEQUENCE = [7, 41, 8, 45, 11, 1]  # "3+4=7<eos>" in the tiny tokenizer
PROMPT_LEN = 4


def main() -> None:
    model, wport, dport, versions = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dport}", rank=0, world_size=1)
    engine = FSDPEngine(
        model, OptimConfig(lr=5e-3), device=torch.device("cpu"), memory=MemoryConfig(micro_batch=3)
    )
    group = WeightGroup("127.0.0.1", wport, 0, 2)
    seq = torch.tensor([SEQUENCE])
    g = torch.Generator().manual_seed(0)
    for version in range(versions):
        if version:
            prompts = [torch.tensor(SEQUENCE[:PROMPT_LEN])] * 8
            responses = [torch.randint(4, 14, (3,), generator=g) for _ in range(8)]
            batch = pack(prompts, responses, [torch.zeros(3)] * 8, torch.randn(8, generator=g), torch.ones(8))
            engine.update_policy(batch)
        group.send(version, engine.manifest(), list(engine.get_weights()))
        with torch.no_grad():
            lp, _ = engine.forward_logprobs(
                pack(
                    [seq[0, :PROMPT_LEN]],
                    [seq[0, PROMPT_LEN:]],
                    [torch.zeros(2)],
                    torch.zeros(1),
                    torch.ones(1),
                ),
                1.0,
            )
        print(json.dumps({"version": version, "logprobs": lp[0, PROMPT_LEN - 1 :].tolist()}), flush=True)
    sys.stdin.read()  # until the test is done with the weight group's store, which this process hosts
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
