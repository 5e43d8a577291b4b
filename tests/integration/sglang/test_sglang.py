"""The SGLang engine for real: GPU only (skipped without one, or without SGLang installed).

The trainer and SGLang share device 0: weights reach SGLang's model process through `load_weights`
(CUDA IPC handles, as the inference service hands over each bucket it received), and logprobs follow
the trainer's after every update. Kernels differ from the trainer's: a looser tolerance than on CPU."""

from __future__ import annotations

import pytest

from meshrl.engines.base import FINISH_INTERRUPTED, SamplingParams
from tests.integration.engine_checks import check_versions, direct

pytest.importorskip("sglang")
pytestmark = pytest.mark.gpu


@pytest.fixture
def engine(arith_model):
    from meshrl.engines.sglang import SGLangEngine

    e = SGLangEngine(str(arith_model), device="cuda:0", max_batch_size=32, mem_fraction=0.3)
    yield e
    e.close()


def test_logprobs_match_the_trainer_after_every_weight_update(engine, arith_model):
    check_versions(engine, arith_model, direct, device="cuda:0", tolerance=1e-3)


def test_an_interrupt_returns_partial_completions(engine):
    calls = 0

    def interrupt() -> bool:
        nonlocal calls
        calls += 1
        return calls > 2

    out = engine.generate([[5, 6, 7]] * 4, SamplingParams(max_new_tokens=100), seeds=[0, 1, 2, 3],
                          interrupt=interrupt)  # fmt: skip
    assert all(c.finish_reason == FINISH_INTERRUPTED and len(c.logprobs) == len(c.tokens) for c in out)
