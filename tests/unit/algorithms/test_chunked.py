"""Chunked log-probs and entropy from hidden states equal the full-logits computation, gradients included."""

from __future__ import annotations

import pytest
import torch

from meshrl.algorithms.chunked import head_logprobs
from meshrl.algorithms.losses import entropy, token_logprobs


def _inputs(bias: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    hidden = (0.5 * torch.randn(13, 8, generator=g)).requires_grad_()
    weight = (0.5 * torch.randn(29, 8, generator=g)).requires_grad_()
    b = torch.randn(29, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, 29, (13,), generator=g)
    coefs = torch.randn(13, generator=g), torch.randn(13, generator=g)  # weights of each output in a loss
    return hidden, weight, b, targets, *coefs  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("chunk", "temperature", "bias"), [(1, 1.0, False), (4, 0.7, True), (100, 1.3, False)]
)
def test_equal_to_the_full_logits_with_equal_gradients(chunk: int, temperature: float, bias: bool) -> None:
    hidden, weight, b, targets, c_lp, c_ent = _inputs(bias)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    logits = (hidden @ weight.T + (b if b is not None else 0))[None]
    lp_full = token_logprobs(logits, targets[None], temperature=temperature)[0]
    ent_full = entropy(logits, temperature=temperature)[0]
    full_grads = torch.autograd.grad((c_lp * lp_full + c_ent * ent_full).sum(), leaves)
    lp, ent = head_logprobs(hidden, weight, targets, bias=b, temperature=temperature, chunk=chunk)
    torch.testing.assert_close(lp, lp_full, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, ent_full, rtol=0, atol=1e-6)
    grads = torch.autograd.grad((c_lp * lp + c_ent * ent).sum(), leaves)
    for got, want in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_an_unused_entropy_adds_nothing_to_the_gradient() -> None:
    hidden, weight, _, targets, c_lp, _ = _inputs(False)
    lp, _ = head_logprobs(hidden, weight, targets, chunk=5)
    logits = (hidden @ weight.T)[None]
    want = torch.autograd.grad((c_lp * token_logprobs(logits, targets[None])[0]).sum(), [hidden, weight])
    for got, w in zip(torch.autograd.grad((c_lp * lp).sum(), [hidden, weight]), want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)


def test_one_chunk_keeps_its_logits_for_the_backward_instead_of_a_second_projection() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, _, targets, c_lp, c_ent = _inputs(False)
    projection = 2 * hidden.shape[0] * weight.shape[0] * hidden.shape[1]  # hidden @ weight.T, once

    def backward_flops(chunk: int) -> int:
        lp, ent = head_logprobs(hidden, weight, targets, chunk=chunk)
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad((c_lp * lp + c_ent * ent).sum(), [hidden, weight])
        return counter.get_total_flops()

    # both gradients (hidden and weight) cost a projection each; recomputing the logits costs a third
    assert backward_flops(chunk=13) == 2 * projection
    assert backward_flops(chunk=7) == 3 * projection


def test_no_positions_give_empty_outputs_and_zero_gradients() -> None:
    hidden, weight, _, targets, _, _ = _inputs(False)
    lp, ent = head_logprobs(hidden[:0], weight, targets[:0], chunk=4)
    assert lp.shape == ent.shape == (0,)
    (g_w,) = torch.autograd.grad((lp.sum() + ent.sum()), [weight])
    assert torch.equal(g_w, torch.zeros_like(weight))
