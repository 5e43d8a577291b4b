"""The frozen-model scorers' math: padded batches give what each row alone gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshrl.dataplane import Ragged
from meshrl.roles.reference.service import response_logprobs
from meshrl.roles.reward_model.service import last_token_scores
from meshrl.roles.scorer import token_batches

REPO = Path(__file__).resolve().parents[2]


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


def test_reference_and_teacher_score_a_sample_in_segments_as_its_segments_apart(tiny_model):
    """An agent program's sample whose history was rewritten holds two sequences: each response token is
    scored within its own (the second segment's tokens see nothing of the first)."""
    from transformers import AutoModelForCausalLM

    from meshrl.roles.teacher.service import TopK

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    p1, r1, p2, r2 = (torch.tensor(x) for x in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [4, 6, 8]))
    prompts, responses = rows(3, seed=2)  # rows of one segment beside it, in the same padded batch
    joined = Ragged.from_list([p1, *prompts])
    after = Ragged.from_list([torch.cat([r1, p2, r2]), *responses])
    segments = Ragged.from_list(
        [
            torch.tensor([5, 7]),
            *(torch.tensor([len(p) + len(r)]) for p, r in zip(prompts, responses, strict=True)),
        ]
    )
    with torch.no_grad():
        got = response_logprobs(model, joined, after, max_tokens=1000, segments=segments)
        alone = response_logprobs(
            model, Ragged.from_list([p1, p2, *prompts]), Ragged.from_list([r1, r2, *responses])
        )
        top = TopK(model, k=3, max_tokens=1000, streamed=False)
        got_top, alone_top = (
            top(joined, after, segments),
            top(Ragged.from_list([p1, p2]), Ragged.from_list([r1, r2])),
        )
    torch.testing.assert_close(got[0][:2], alone[0], atol=1e-5, rtol=0)  # the first segment's response
    torch.testing.assert_close(got[0][-3:], alone[1], atol=1e-5, rtol=0)  # the second's
    for k in range(3):
        torch.testing.assert_close(got[k + 1], alone[k + 2], atol=1e-5, rtol=0)
    torch.testing.assert_close(got_top[1][0][-3:], alone_top[1][1], atol=1e-5, rtol=0)
    unaware = response_logprobs(model, joined, after, max_tokens=1000)
    assert not torch.allclose(unaware[0][-3:], alone[1], atol=1e-3)  # without segments it would differ


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


@pytest.mark.parametrize("streamed", [True, False])
def test_teacher_topk_matches_the_model_row_by_row(tiny_model, streamed):
    from transformers import AutoModelForCausalLM

    from meshrl.algorithms.chunked import head_is_linear
    from meshrl.roles.teacher.service import TopK

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    assert head_is_linear(model)
    prompts, responses = rows(7, seed=3)
    topk = TopK(model, k=5, temperature=0.8, max_tokens=20, token_chunk=4, vocab_chunk=7, streamed=streamed)
    ids, lps, sampled = topk(prompts, responses)
    with torch.no_grad():
        for i in range(7):
            seq = torch.cat([prompts[i], responses[i]])
            lp = torch.log_softmax(model(input_ids=seq[None]).logits[0, :-1] / 0.8, -1)[len(prompts[i]) - 1 :]
            top = lp.topk(5, -1)
            assert ids[i].dtype == torch.int32 and torch.equal(ids[i].long(), top.indices)
            torch.testing.assert_close(lps[i], top.values, atol=1e-5, rtol=0)
            torch.testing.assert_close(
                sampled[i], lp.gather(-1, responses[i][:, None]).squeeze(-1), atol=1e-5, rtol=0
            )


def test_teacher_with_another_vocabulary_fails_at_start_up(tiny_model, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from meshrl.planning.config import RecipeError
    from meshrl.planning.recipe import load_recipe
    from meshrl.planning.topology import Device, plan

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<tool>"])
    tok.save_pretrained(other)
    recipe = load_recipe(
        REPO / "recipes" / "opd_arith.py", [f"*.model={tiny_model}", f"teacher.model={other}"]
    )
    with pytest.raises(RecipeError, match=r"teacher's tokenizer \(\d+ tokens\) differs from the student's"):
        plan(recipe, [Device(i, "localhost", i) for i in range(3)])
    ok = load_recipe(REPO / "recipes" / "opd_arith.py", [f"*.model={tiny_model}"])
    assert plan(ok, [Device(i, "localhost", i) for i in range(3)]).replicas


def test_a_restarted_scorer_keeps_rows_its_predecessor_wrote(plane):
    from meshrl.dataplane import Client
    from meshrl.dataplane.missing import put_missing

    with Client(plane.controller) as c:
        c.create_partition("rows", 16)
        ids = c.put("rows", {"x": torch.arange(4)})
        first = [torch.full((k + 1,), float(k)) for k in range(4)]
        c.put("rows", {"lp": first[1:3], "score": torch.tensor([1.0, 2.0])}, ids=ids[1:3])  # then it died
        again = [torch.full((k + 1,), 10.0 + k) for k in range(4)]
        assert (
            put_missing(c, "rows", {"lp": Ragged.from_list(again), "score": torch.arange(4.0) + 10}, ids) == 2
        )
        got = c.claim("rows", "trainer", ["lp", "score"], 4)
        assert got.ids.tolist() == ids.tolist()
        assert [float(row[0]) for row in got.ragged("lp")] == [10.0, 1.0, 2.0, 13.0]
        assert got.tensor("score").tolist() == [10.0, 1.0, 2.0, 13.0]
        c.ack(got)
        assert put_missing(c, "rows", {"y": torch.arange(4)}, ids) == 0  # nothing there yet: one put


@pytest.mark.parametrize("asynchronous", [False, True])
def test_rows_a_checkpoint_caught_between_put_and_ack_are_kept_or_skipped_once_resumed(
    tmp_path, asynchronous
):
    """A checkpoint snapshots the data plane while stateless services (inference, the scorers) work on:
    it can catch rows with a service's column written and its claim not yet acknowledged. Restored, the
    rows go to that service again, while the others, seeing the column, take them to the end and the
    trainer's ack deletes them; the service's put must then keep what is there and skip what is gone
    (it failed the resumed run with 'unknown row ids': tests/integration/ppo, actor-critic resume)."""
    import asyncio

    from meshrl.dataplane import AsyncClient, Client
    from meshrl.dataplane.missing import put_missing, put_missing_async
    from tests.conftest import start_plane, stop_plane

    snap = tmp_path / "checkpoint"
    first = start_plane(tmp_path)
    try:
        with Client(first.controller) as c:
            c.create_partition("samples", 64, delete_when_acked_by=["trainer"])
            ids = c.put("samples", {"prompt": torch.arange(4)})
            claim = c.claim("samples", "inference", ["prompt"], 4)
            c.put("samples", {"response": torch.arange(4) + 10}, ids=claim.ids)  # inference's put,
            c.snapshot(snap)  # the checkpoint,
            c.ack(claim)  # inference's ack
    finally:
        stop_plane(first)
    second = start_plane(tmp_path, "--restore", str(snap))  # the resumed run
    try:
        with Client(second.controller) as c:
            again = c.claim("samples", "inference", ["prompt"], 4)
            assert again.ids.tolist() == ids.tolist()  # handed out again
            trained = c.claim("samples", "trainer", ["prompt", "response"], 2)  # meanwhile
            c.ack(trained)  # rows 0 and 1 are deleted
            columns = {"response": torch.arange(4) + 20}  # (sampled afresh, or the same: either way)
            if asynchronous:

                async def put() -> int:
                    client = await AsyncClient.connect(second.controller)
                    try:
                        return await put_missing_async(client, "samples", columns, again.ids)
                    finally:
                        await client.close()

                assert asyncio.run(put()) == 4
            else:
                assert put_missing(c, "samples", columns, again.ids) == 4
            c.ack(again)
            rest = c.claim("samples", "trainer", ["prompt", "response"], 4)
            assert rest.ids.tolist() == ids[2:].tolist() and rest.tensor("response").tolist() == [12, 13]
            c.ack(rest)
            assert c.status().partitions[0].rows == 0
    finally:
        stop_plane(second)
