"""The frozen-model scorers' math: padded batches give what each row alone gives."""

from __future__ import annotations

import torch

from meshrl.dataplane import Ragged
from meshrl.roles.reference.service import response_logprobs
from meshrl.roles.reward_model.service import last_token_scores
from meshrl.roles.scorer import token_batches


def rows(n: int, seed: int = 0) -> tuple[Ragged, Ragged]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 40, (int(k),), generator=g) for k in torch.randint(2, 7, (n,), generator=g)]
    responses = [torch.randint(4, 40, (int(k),), generator=g) for k in torch.randint(1, 6, (n,), generator=g)]
    return Ragged.from_list(prompts), Ragged.from_list(responses)


def test_token_batches_respect_the_budget_and_cover_every_row():
    lengths = torch.tensor([5, 1, 9, 3, 3, 7, 20])
    chunks = token_batches(lengths, 12)
    assert sorted(torch.cat(chunks).tolist()) == list(range(7))
    for c in chunks:
        assert len(c) == 1 or len(c) * int(lengths[c].max()) <= 12
    assert [len(c) for c in token_batches(lengths, 1000)] == [7]


def test_reference_logprobs_match_unpadded_rows(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompts, responses = rows(7)
    with torch.no_grad():
        out = response_logprobs(model, prompts, responses, temperature=0.7, max_tokens=24)
        for i in range(7):
            ids = torch.cat([prompts[i], responses[i]])[None]
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / 0.7, -1)
            want = lp[torch.arange(len(ids[0]) - 1), ids[0, 1:]][len(prompts[i]) - 1 :]
            torch.testing.assert_close(out[i], want, atol=1e-5, rtol=0)


def test_reward_model_scores_match_unpadded_rows(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from meshrl.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "rm", reward_model=True, seed=3)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    prompts, responses = rows(6, seed=1)
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
    seqs[0] = torch.cat([seqs[0], torch.tensor([1])])  # ends with the EOS id (= what padding often uses)
    with torch.no_grad():
        got = last_token_scores(model, seqs)
        for i, s in enumerate(seqs):
            want = model(input_ids=s[None]).logits[0, 0]
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)
    assert model.config.pad_token_id == 0  # restored
