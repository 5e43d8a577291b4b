"""The SGLang engine's adapter logic against a stand-in for SGLang's offline `Engine` (SGLang runs on GPU
only; `tests/integration/test_gpu_engines.py` runs the real one where a GPU is present).

The stand-in speaks SGLang's documented shapes: token ids in, results with `output_ids` and `meta_info`
(`output_token_logprobs` as (logprob, id, text) triples, `finish_reason` {"type": ...}), prompt
logprobs from `logprob_start_len=0`, `(success, message)` from weight updates, aborts by request id."""

from __future__ import annotations

import asyncio

import pytest
import torch

from meshrl.engines import sglang as sglang_engine
from meshrl.engines.base import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, SamplingParams


class FakeSGLang:
    """SGLang's `Engine`: each request emits token 10 + (seed + step) % 5 every 2 ms, with logprob -0.1 *
    (step + 1), and stops on a stop token or after max_new_tokens; weight calls are recorded."""

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = self
        self.aborted: set[str] = set()
        self.updates: list[list[tuple[str, torch.Tensor]]] = []
        self.flushes = 0
        self.fail_update = False
        self.sampling: list[dict] = []

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted.add(rid)

    async def _one(self, prompt: list[int], sp: dict, rid: str) -> dict:
        out: list[int] = []
        reason = {"type": "length", "length": sp["max_new_tokens"]}
        for step in range(sp["max_new_tokens"]):
            await asyncio.sleep(0.002)
            if rid in self.aborted:
                reason = {"type": "abort", "message": "aborted"}
                break
            token = 10 + (sp.get("sampling_seed", 0) + step) % 5
            out.append(token)
            if token in sp["stop_token_ids"]:
                reason = {"type": "stop", "matched": token}
                break
        logprobs = [(-0.1 * (i + 1), t, None) for i, t in enumerate(out)]
        return {
            "output_ids": out,
            "meta_info": {"id": rid, "output_token_logprobs": logprobs, "finish_reason": reason},
        }

    async def async_generate(self, *, input_ids, sampling_params, return_logprob, rid):
        assert return_logprob
        self.sampling = sampling_params
        return list(
            await asyncio.gather(
                *(self._one(p, s, r) for p, s, r in zip(input_ids, sampling_params, rid, strict=True))
            )
        )

    def generate(self, *, input_ids, sampling_params, return_logprob, logprob_start_len):
        assert return_logprob and logprob_start_len == 0 and sampling_params["max_new_tokens"] == 1
        return [{"meta_info": {"input_token_logprobs": [(None, s[0], None)] + [(-0.5 * j, t, None) for j, t in enumerate(s[1:], 1)]}}
                for s in input_ids]  # fmt: skip

    def update_weights_from_tensor(self, named, flush_cache=True):
        assert not flush_cache
        if self.fail_update:
            return False, "shapes do not match"
        self.updates.append(named)
        return True, "Success"

    def flush_cache(self):
        self.flushes += 1
        return type("FlushCacheReqOutput", (), {"success": True})()

    def shutdown(self) -> None:
        self.loop.close()


@pytest.fixture
def engine(tiny_model, monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeSGLang))
    monkeypatch.setattr(sglang_engine, "available", lambda: True)
    e = sglang_engine.SGLangEngine(str(tiny_model), device="cuda:3", max_batch_size=8, seed=5)
    yield e
    e.close()


def test_starts_sglang_on_the_replicas_gpu_without_a_tokenizer(engine):
    kw = engine.engine.kwargs
    assert kw["skip_tokenizer_init"] and kw["base_gpu_id"] == 3 and kw["max_running_requests"] == 8
    assert kw["random_seed"] == 5
    assert engine.eos_token_ids() and engine.parameters()


def test_refuses_a_cpu_device_and_names_the_install_command(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="runs on GPU"):
        monkeypatch.setattr(sglang_engine, "available", lambda: True)
        sglang_engine.SGLangEngine(str(tiny_model), device="cpu")
    monkeypatch.setattr(sglang_engine, "available", lambda: False)
    with pytest.raises(ImportError, match=r"meshrl\[sglang\]"):
        sglang_engine.SGLangEngine(str(tiny_model), device="cuda:0")


def test_generation_maps_params_seeds_logprobs_and_finish_reasons(engine):
    assert not set(engine.eos_token_ids()) & set(range(10, 15))  # the stand-in's tokens
    params = SamplingParams(temperature=0.7, max_new_tokens=4, stop_token_ids=(12,))
    out = engine.generate([[5, 6], [7], [8, 9]], params, seeds=[0, 1, 3])
    sp = engine.engine.sampling
    assert [s["sampling_seed"] for s in sp] == [0, 1, 3]
    assert sp[0]["temperature"] == 0.7 and sp[0]["top_k"] == -1 and sp[0]["max_new_tokens"] == 4
    assert set(sp[0]["stop_token_ids"]) == {*engine.eos_token_ids(), 12}
    assert out[0].tokens == [10, 11, 12] and out[0].finish_reason == FINISH_STOP  # the stop token is kept
    assert out[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert out[2].tokens == [13, 14, 10, 11] and out[2].finish_reason == FINISH_LENGTH
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[10**6]], params)
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        engine.generate([[5]], params, seeds=[1, 2])
    engine.generate([[5], [6]], SamplingParams(seed=2**64 - 1))  # a batch seed: seed + row, kept in int64
    assert [s["sampling_seed"] for s in engine.engine.sampling] == [(2**64 - 1) % 2**63, 0]


def test_an_interrupt_aborts_the_unfinished_requests_and_keeps_what_they_have(engine):
    calls = 0

    def interrupt() -> bool:
        nonlocal calls
        calls += 1
        return calls > 3  # after ~2-3 tokens

    out = engine.generate([[5], [6]], SamplingParams(max_new_tokens=200), seeds=[1, 1], interrupt=interrupt)
    assert all(c.finish_reason == FINISH_INTERRUPTED for c in out)
    assert all(0 < len(c.tokens) < 200 and len(c.logprobs) == len(c.tokens) for c in out)


def test_weights_are_checked_handed_over_and_the_cache_flushed_per_version(engine):
    name, shape, _ = engine.parameters()[0]
    engine.load_weights([(name, torch.zeros(shape))])
    assert engine.engine.updates[0][0][0] == name and engine.engine.flushes == 0
    engine.set_version(1)
    assert engine.engine.flushes == 1 and engine.version == 1
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.load_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.load_weights([(name, torch.zeros(1, 2, 3))])
    engine.engine.fail_update = True
    with pytest.raises(RuntimeError, match="shapes do not match"):
        engine.load_weights([(name, torch.zeros(shape))])


def test_score_reads_prompt_logprobs_from_the_prompt_length_on(engine):
    assert engine.score([[5, 6, 7, 8]], [2]) == [[-1.0, -1.5]]
    with pytest.raises(NotImplementedError):
        engine.score([[5, 6]], [1], temperature=0.7)
