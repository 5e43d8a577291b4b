"""Checks shared by the tests of engines that serve a model in processes of their own (vLLM, SGLang):
logprobs against the trainer's after each of several real weight updates, published directly or
through a weight group."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch


def direct(engine, version, manifest, tensors) -> None:
    engine.load_weights(zip([name for name, _, _ in manifest], tensors, strict=True))
    engine.set_version(version)


class WeightLink:
    """A trainer-side weight group (rank 0, on a thread) and the engine's workers as rank 1, as the
    trainer and inference services hold them."""

    def __init__(self, engine, shm_dir, device: str = "cpu") -> None:
        from meshrl.runtime.weights import WeightGroup
        from tests.conftest import free_base_port

        port = free_base_port()
        self.engine = engine
        self.pool = ThreadPoolExecutor(1)
        shm = (str(shm_dir), "meshrl-test-weights") if shm_dir is not None else None
        # both ends form the group together: the trainer's on the thread, the workers' here
        trainer = self.pool.submit(
            WeightGroup, "127.0.0.1", port, 0, 2, timeout_s=120, shm=shm, device=device
        )
        self.receiver = WeightGroup(
            "127.0.0.1", port, 1, 2, timeout_s=120, member=engine.weight_member(), device=device
        )
        self.trainer = trainer.result(timeout=120)

    def publish(self, engine, version, manifest, tensors) -> None:
        sent = self.pool.submit(self.trainer.send, version, manifest, tensors, bucket_bytes=20_000)
        while not self.receiver.store.check([f"pub/{self.receiver.published + 1}"]):
            if sent.done():  # the trainer's side failed before announcing: its error, not a hang
                sent.result()
            time.sleep(0.01)
        header = self.receiver.wait()
        assert header["version"] == version
        if "shm" not in header:
            assert len(header["buckets"]) > 3  # several buckets, each broadcast into the workers
        self.receiver.receive(header, lambda named: pytest.fail("the workers, not this process, load"))
        sent.result(timeout=120)
        engine.set_version(version)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.trainer.close()
        assert self.receiver.wait()["version"] == -1
        self.pool.shutdown()


def check_versions(
    engine,
    arith_model,
    publish,
    device: str = "cpu",
    tolerance: float = 1e-5,
    prompts=None,
    images=None,
    **trainer_kw,
) -> None:
    """`prompts` (token ids; random ones by default) and their `images` (a vision-language model's);
    `trainer_kw`: the trainer engine's settings (precision, lora)."""
    from meshrl.engines.base import SamplingParams
    from meshrl.engines.fsdp import FSDPEngine
    from meshrl.engines.optim import OptimConfig
    from meshrl.engines.packing import pack
    from meshrl.engines.settings import MemoryConfig

    memory = MemoryConfig(micro_batch=16, precision=trainer_kw.pop("precision", "fp32"))
    trainer = FSDPEngine(
        str(arith_model), OptimConfig(lr=3e-2), device=torch.device(device), memory=memory, **trainer_kw
    )
    g = torch.Generator().manual_seed(0)
    if prompts is None:
        prompts = [[int(t) for t in torch.randint(4, 16, (int(n),), generator=g)] for n in (3, 5, 2, 7, 4, 6)]
    previous = None
    for version in range(4):
        if version:  # one real policy update, then publish it
            rows = [torch.tensor(p) for p in prompts]
            batch = pack(rows, [torch.tensor([5, 6, 7])] * len(rows), [torch.full((3,), -2.0)] * len(rows),
                         torch.randn(len(rows), generator=g), torch.ones(len(rows), dtype=torch.bool),
                         images=images)  # fmt: skip
            trainer.update_policy(batch)
            publish(engine, version, trainer.manifest(), list(trainer.get_weights()))
        assert engine.version == version
        out = engine.generate(
            prompts, SamplingParams(max_new_tokens=6), seeds=list(range(len(prompts))), images=images
        )
        assert all(c.tokens and len(c.logprobs) == len(c.tokens) for c in out)
        packed = pack([torch.tensor(p) for p in prompts], [torch.tensor(c.tokens) for c in out], None,
                      torch.zeros(len(out)), torch.ones(len(out), dtype=torch.bool), images=images)  # fmt: skip
        with torch.no_grad():
            lp, _ = trainer.forward_logprobs(packed, 1.0)
        mine = torch.cat([torch.tensor(c.logprobs) for c in out])
        theirs = lp[packed.mask]
        assert (mine - theirs.cpu()).abs().max() < tolerance, (version, (mine - theirs.cpu()).abs().max())
        # the update really reached vLLM: the same first tokens are now scored differently
        first = torch.tensor(
            engine.score([prompts[0] + out[0].tokens[:1]], [len(prompts[0])], images=images and images[:1])[0]
        )
        if previous is not None:
            assert (first - previous).abs().max() > 1e-4
        previous = first
