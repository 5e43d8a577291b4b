"""On-policy distillation math: the streamed top-k, the forward-KL loss, the reverse-KL advantage."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.algorithms.distill import reverse_kl_advantages, topk_forward_kl, topk_logprobs
from meshrl.dataplane import Ragged
from meshrl.engines.packing import pack


@pytest.mark.parametrize(
    ("token_chunk", "vocab_chunk", "temperature"), [(7, 5, 1.0), (100, 3, 0.7), (1, 1000, 1.3)]
)
def test_streamed_topk_equals_the_full_vocabulary_reference(token_chunk, vocab_chunk, temperature):
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = (
        torch.randn(23, 16, generator=g),
        torch.randn(37, 16, generator=g),
        torch.randn(37, generator=g),
    )
    ids, lps, lse = topk_logprobs(
        hidden,
        weight,
        6,
        bias=bias,
        temperature=temperature,
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
    )
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    want = logp.topk(6, dim=-1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(lps, want.values, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        lse, torch.logsumexp((hidden @ weight.T + bias) / temperature, -1), atol=1e-5, rtol=0
    )
    with pytest.raises(ValueError, match="top-k must be in"):
        topk_logprobs(hidden, weight, 38)


def test_forward_kl_matches_a_hand_computed_value():
    # student uniform over 4 tokens; teacher's top-2 {1: 0.5, 2: 0.25} renormalises to {2/3, 1/3}
    logits = torch.zeros(1, 1, 4, requires_grad=True)
    ids = torch.tensor([[[1, 2]]])
    lps = torch.tensor([[[math.log(0.5), math.log(0.25)]]])
    loss, per = topk_forward_kl(logits, ids, lps, torch.tensor([[True]]))
    want = 2 / 3 * (math.log(2 / 3) + math.log(4)) + 1 / 3 * (math.log(1 / 3) + math.log(4))
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert per["agree"].item() == 0.0  # the student's argmax (token 0) is not the teacher's top-1
    loss.backward()
    # d/dz of -sum_j q_j log p_j = p - q (q zero outside the top-k)
    torch.testing.assert_close(logits.grad[0, 0], torch.tensor([0.25, 0.25 - 2 / 3, 0.25 - 1 / 3, 0.25]))
    # the student matching the teacher on the set pays only for the mass outside it: here none
    exact = torch.log(torch.tensor([[[1e-9, 2 / 3, 1 / 3, 1e-9]]]))
    loss, per = topk_forward_kl(exact, ids, lps, torch.tensor([[True]]))
    assert loss.item() == pytest.approx(0.0, abs=1e-6) and per["agree"].item() == 1.0


def test_floor_bounds_the_loss_of_a_ruled_out_token():
    logits = torch.tensor([[[0.0, -1e4, 0.0]]], requires_grad=True)
    loss, _ = topk_forward_kl(
        logits, torch.tensor([[[1]]]), torch.tensor([[[0.0]]]), torch.tensor([[True]]), floor=-20.0
    )
    assert loss.item() == pytest.approx(20.0)
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_masked_positions_and_ragged_rows_do_not_reach_the_loss():
    """Rows of different lengths packed as the trainer packs them: the loss is the token-mean of each
    row's own per-token KL, whatever the padding holds (here NaN teacher values)."""
    g = torch.Generator().manual_seed(1)
    prompts = Ragged.from_list([torch.tensor([5, 6, 7]), torch.tensor([8])])
    responses = Ragged.from_list([torch.tensor([9, 10]), torch.tensor([11, 12, 13, 14])])
    k, vocab = 3, 20
    top_ids = Ragged.from_list([torch.randint(0, vocab, (n, k), generator=g) for n in (2, 4)])
    top_lp = Ragged.from_list([torch.log_softmax(torch.randn(n, k, generator=g), -1) for n in (2, 4)])
    sampled = Ragged.from_list([torch.randn(n, generator=g) for n in (2, 4)])
    batch = pack(prompts, responses, None, torch.zeros(2), torch.ones(2, dtype=torch.bool),
                 teachers={"t": (top_ids, top_lp, sampled)})  # fmt: skip
    ids, lps, samp = batch.teachers["t"]
    assert ids.shape == (2, 4, k) and lps.shape == (2, 4, k) and samp.shape == (2, 4)
    assert torch.equal(ids[0, 2:4], top_ids[0]) and torch.equal(ids[1, 0:4], top_ids[1])
    lps = torch.where(batch.mask[..., None], lps, torch.nan)
    logits = torch.randn(2, 4, vocab, generator=g, requires_grad=True)
    loss, per = topk_forward_kl(logits, ids, lps, batch.mask)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[~batch.mask] == 0).all()

    def one(logit_rows: torch.Tensor, i: int) -> torch.Tensor:
        student = torch.log_softmax(logit_rows, -1).gather(-1, top_ids[i].long())
        q = torch.softmax(top_lp[i], -1)
        return (q * (q.log() - student)).sum(-1)

    rows = torch.cat([one(logits[0, 2:4], 0), one(logits[1, 0:4], 1)])
    torch.testing.assert_close(loss, rows.mean())
    torch.testing.assert_close(per["kl"][batch.mask], rows.detach())


def test_reverse_kl_advantage_is_teacher_minus_student_on_response_tokens():
    teacher = torch.tensor([[-0.1, -2.0, 5.0]])
    student = torch.tensor([[-0.5, -1.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(
        reverse_kl_advantages(teacher, student, mask), torch.tensor([[0.4, -1.0, 0.0]])
    )


def test_trainer_mixes_task_and_per_teacher_reverse_kl_advantages(tmp_path):
    from meshrl.engines.settings import DistillConfig, LossConfig
    from meshrl.roles.trainer.config import TrainerConfig
    from meshrl.roles.trainer.service import distilled_advantages

    prompts = Ragged.from_list([torch.tensor([5, 6]), torch.tensor([7])])
    responses = Ragged.from_list([torch.tensor([8, 9]), torch.tensor([10, 11, 12])])
    behaviour = Ragged.from_list([torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -0.5, -0.5])])

    def teacher(values: list[list[float]]) -> tuple[Ragged, Ragged, Ragged]:
        lp = Ragged.from_list([torch.tensor(v) for v in values])
        ids = Ragged.from_list([torch.zeros(len(v), 2, dtype=torch.int32) for v in values])
        return ids, Ragged.from_list([torch.zeros(len(v), 2) for v in values]), lp

    batch = pack(prompts, responses, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.bool),
                 teachers={"a": teacher([[-1.0, -1.0], [0.0, 0.0, 0.0]]), "b": teacher([[0.0, 0.0], [-1.5, -0.5, 0.5]])})  # fmt: skip
    cfg = TrainerConfig(
        model=str(tmp_path),
        distill=DistillConfig(teachers={"a": 1.0, "b": 0.5}, advantage=2.0),
        loss=LossConfig(pg_coef=0.5),
    )
    adv = distilled_advantages(batch, cfg)
    m = batch.mask
    # row 0: 0.5 * 1 + 2 * (1 * (t_a - b) + 0.5 * (t_b - b)), tokens b = -1, -2
    want0 = torch.tensor([0.5 + 2 * (0.0 + 0.5 * 1.0), 0.5 + 2 * (1.0 + 0.5 * 2.0)])
    want1 = torch.tensor(
        [-0.5 + 2 * (0.5 + 0.5 * -1.0), -0.5 + 2 * (0.5 + 0.5 * 0.0), -0.5 + 2 * (0.5 + 0.5 * 1.0)]
    )
    torch.testing.assert_close(adv[0][m[0]], want0)
    torch.testing.assert_close(adv[1][m[1]], want1)
    assert (adv[~m] == 0).all()
