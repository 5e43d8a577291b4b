"""HFEngine on a tiny random Qwen2 model saved to disk: stopping, log-probabilities (against `score()` and
against the model run by hand), seeds and sampling filters, weight loading, errors.

The model's weights are drawn larger than the default init so that next-token distributions are peaked
(greedy, top-k and temperature then visibly differ) while float32 noise stays well under 1e-5.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from meshrl.engines.base import Completion, SamplingParams
from meshrl.engines.hf import HFEngine

VOCAB, EOS, PAD = 32, 1, 0
TOL = 1e-5
PROMPTS = [[5, 6, 7], [3] * 10, [9], [4, 5, 6, 7, 8, 9, 10, 11], [12, 2]]
_rng = random.Random(0)
MANY_PROMPTS = [[_rng.randrange(2, VOCAB) for _ in range(_rng.randint(1, 12))] for _ in range(24)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The tiny model gains nothing from intra-op threads, which slow it down 20x when other processes
    compete for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> HFEngine:
    """Shared by the tests that do not change weights."""
    return HFEngine(str(model_dir))


@pytest.fixture
def fresh_engine(model_dir: Path) -> HFEngine:
    return HFEngine(str(model_dir))


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> PreTrainedModel:
    """The same checkpoint loaded straight from transformers, run by hand without a cache."""
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def full_logits(model: PreTrainedModel, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float()


def max_diff(completions: list[Completion], scores: list[list[float]]) -> float:
    worst = 0.0
    for c, s in zip(completions, scores, strict=True):
        assert len(c.logprobs) == len(c.tokens) == len(s)
        worst = max([worst, *(abs(a - b) for a, b in zip(c.logprobs, s, strict=True))])
    return worst


def score_completions(
    engine: HFEngine, prompts: list[list[int]], completions: list[Completion], temperature: float
) -> list[list[float]]:
    seqs = [p + c.tokens for p, c in zip(prompts, completions, strict=True)]
    return engine.score(seqs, [len(p) for p in prompts], temperature=temperature)


def test_parameters_lists_every_named_parameter(engine: HFEngine, reference: PreTrainedModel) -> None:
    expected = [(name, tuple(p.shape), "float32") for name, p in reference.named_parameters()]
    assert engine.parameters() == expected
    names = [name for name, _, _ in expected]
    assert "model.embed_tokens.weight" in names and "model.layers.1.mlp.down_proj.weight" in names
    assert dict((n, s) for n, s, _ in engine.parameters())["model.embed_tokens.weight"] == (VOCAB, 32)
    assert engine.eos_token_ids() == [EOS]
    assert engine.version == 0


def test_max_new_tokens_and_finish_reasons(engine: HFEngine) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=0)
    completions = engine.generate(MANY_PROMPTS * 4, params)
    assert len(completions) == len(MANY_PROMPTS) * 4
    for c in completions:
        assert len(c.logprobs) == len(c.tokens)
        assert all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "length":
            assert len(c.tokens) == 5 and EOS not in c.tokens
        else:
            assert c.finish_reason == "stop"
            assert 1 <= len(c.tokens) <= 5 and c.tokens[-1] == EOS and EOS not in c.tokens[:-1]
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    assert engine.generate([], params) == []


def test_stops_on_the_models_eos(fresh_engine: HFEngine) -> None:
    # Make the last layer add a huge constant along hidden dimension 0 (v_proj ignores its input and
    # emits its bias, which o_proj copies into the residual stream), and give EOS's output embedding a
    # large weight on that dimension: EOS then wins at every position, whatever the prompt.
    shapes = {name: shape for name, shape, _ in fresh_engine.parameters()}
    v_bias = torch.zeros(shapes["model.layers.1.self_attn.v_proj.bias"])
    v_bias[0] = 100.0
    o_proj = torch.zeros(shapes["model.layers.1.self_attn.o_proj.weight"])
    o_proj[0, 0] = 1.0
    embed = fresh_engine.model.get_input_embeddings().weight.detach().clone()
    embed[EOS, 0] = 50.0
    fresh_engine.load_weights(
        [
            (
                "model.layers.1.self_attn.v_proj.weight",
                torch.zeros(shapes["model.layers.1.self_attn.v_proj.weight"]),
            ),
            ("model.layers.1.self_attn.v_proj.bias", v_bias),
            ("model.layers.1.self_attn.o_proj.weight", o_proj),
            ("lm_head.weight", embed),  # tied: writes the input embedding too
        ]
    )
    for params in (GREEDY, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)):
        for c in fresh_engine.generate(PROMPTS, params):
            assert c.tokens == [EOS] and c.finish_reason == "stop"
            assert c.logprobs[0] == pytest.approx(0.0, abs=1e-4)


def test_stop_token_ids_end_each_row_at_its_first_stop(
    engine: HFEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept: list[int] = []
    select = DynamicCache.batch_select_indices

    def spy(cache: DynamicCache, indices: torch.Tensor) -> None:
        kept.append(len(indices))
        select(cache, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", spy)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    free = engine.generate(MANY_PROMPTS, params)
    # The most frequent non-EOS token: rows stop on it at different steps (exercises dropping rows).
    counts: dict[int, int] = {}
    for c in free:
        for t in set(c.tokens) - {EOS}:
            counts[t] = counts.get(t, 0) + 1
    stop_tok = max(counts, key=lambda t: counts[t])
    stopped = engine.generate(MANY_PROMPTS, dataclasses.replace(params, stop_token_ids=(stop_tok,)))
    n_stopped = 0
    for f, s in zip(free, stopped, strict=True):
        if stop_tok in f.tokens:
            n = f.tokens.index(stop_tok) + 1
            assert s.tokens == f.tokens[:n] and s.finish_reason == "stop"
            assert s.logprobs == pytest.approx(f.logprobs[:n], abs=TOL)
            n_stopped += 1
        else:
            assert s.tokens == f.tokens and s.finish_reason == f.finish_reason
    assert 0 < n_stopped < len(MANY_PROMPTS)
    assert kept, "finished rows were never dropped from the batch"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_new_tokens=16),
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=1),
        SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=16, seed=2),
        SamplingParams(temperature=1.5, top_p=0.95, max_new_tokens=16, seed=3),
    ],
    ids=["greedy", "t1", "t0.7-topk-topp", "t1.5-topp"],
)
def test_logprobs_match_score_for_prompts_of_different_lengths(
    engine: HFEngine, params: SamplingParams
) -> None:
    assert len({len(p) for p in MANY_PROMPTS}) > 5
    completions = engine.generate(MANY_PROMPTS, params)
    scores = score_completions(engine, MANY_PROMPTS, completions, params.temperature)
    assert max_diff(completions, scores) < TOL


def test_greedy_is_argmax_step_by_step_and_independent_of_padding(
    engine: HFEngine, reference: PreTrainedModel
) -> None:
    batched = engine.generate(PROMPTS, GREEDY)
    assert engine.generate(PROMPTS, GREEDY) == batched
    for prompt, c in zip(PROMPTS, batched, strict=True):
        seq = list(prompt)
        for tok, lp in zip(c.tokens, c.logprobs, strict=True):
            logits = full_logits(reference, seq)[-1]
            assert tok == int(logits.argmax())
            assert lp == pytest.approx(float(logits.log_softmax(-1)[tok]), abs=TOL)
            seq.append(tok)
        alone = engine.generate([prompt], GREEDY)[0]
        assert alone.tokens == c.tokens and alone.finish_reason == c.finish_reason
        assert alone.logprobs == pytest.approx(c.logprobs, abs=TOL)


def test_batch_chunks_give_the_same_greedy_completions(model_dir: Path, engine: HFEngine) -> None:
    small = HFEngine(str(model_dir), max_batch_size=5)
    expected = engine.generate(MANY_PROMPTS, GREEDY)
    got = small.generate(MANY_PROMPTS, GREEDY)
    assert [c.tokens for c in got] == [c.tokens for c in expected]
    assert max_diff(got, [c.logprobs for c in expected]) < TOL
    seqs = [p + c.tokens for p, c in zip(MANY_PROMPTS, got, strict=True)]
    lens = [len(p) for p in MANY_PROMPTS]
    assert max_diff(got, small.score(seqs, lens, temperature=0.0)) < TOL


def test_seeds(engine: HFEngine) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=123)
    first = engine.generate(MANY_PROMPTS, params)
    assert engine.generate(MANY_PROMPTS, params) == first  # tokens and logprobs alike
    other = engine.generate(MANY_PROMPTS, dataclasses.replace(params, seed=124))
    assert [c.tokens for c in other] != [c.tokens for c in first]
    unseeded = dataclasses.replace(params, seed=None)
    a, b = engine.generate(MANY_PROMPTS, unseeded), engine.generate(MANY_PROMPTS, unseeded)
    assert [c.tokens for c in a] != [c.tokens for c in b]


def test_top_k_1_and_tiny_top_p_equal_greedy(engine: HFEngine) -> None:
    greedy = engine.generate(MANY_PROMPTS, GREEDY)
    for params in (
        SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8, seed=5),
        SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8, seed=6),
    ):
        sampled = engine.generate(MANY_PROMPTS, params)
        assert [c.tokens for c in sampled] == [c.tokens for c in greedy]
        # At temperature 1 the convention gives log_softmax(logits), the same as greedy's.
        assert max_diff(sampled, [c.logprobs for c in greedy]) < TOL


def test_sampling_follows_top_k(engine: HFEngine, reference: PreTrainedModel) -> None:
    params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=1, seed=0)
    prompt = PROMPTS[0]
    allowed = set(full_logits(reference, prompt)[-1].topk(3).indices.tolist())
    seen = {c.tokens[0] for c in engine.generate([prompt] * 64, params)}
    assert seen <= allowed and len(seen) > 1


def test_temperature_scales_logprobs(engine: HFEngine, reference: PreTrainedModel) -> None:
    params = SamplingParams(temperature=2.0, max_new_tokens=8, seed=7)
    for prompt, c in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        logits = full_logits(reference, prompt + c.tokens)[len(prompt) - 1 : -1]
        targets = torch.tensor(c.tokens).unsqueeze(-1)
        at_t2 = (logits / 2.0).log_softmax(-1).gather(-1, targets).squeeze(-1).tolist()
        at_t1 = logits.log_softmax(-1).gather(-1, targets).squeeze(-1).tolist()
        assert c.logprobs == pytest.approx(at_t2, abs=TOL)
        assert c.logprobs != pytest.approx(at_t1, abs=1e-3)
        seq, n = [prompt + c.tokens], [len(prompt)]
        assert engine.score(seq, n, temperature=2.0)[0] == pytest.approx(at_t2, abs=TOL)
        assert engine.score(seq, n)[0] == pytest.approx(at_t1, abs=TOL)
        assert engine.score(seq, n, temperature=0.0)[0] == pytest.approx(at_t1, abs=TOL)


def test_score_edges(engine: HFEngine) -> None:
    assert engine.score([[5, 6, 7], [5, 6]], [3, 1]) == [[], pytest.approx(engine.score([[5, 6]], [1])[0])]
    assert engine.score([], []) == []
    with pytest.raises(ValueError, match=r"prompt_lens\[0\]"):
        engine.score([[5, 6]], [0])
    with pytest.raises(ValueError, match=r"prompt_lens\[0\]"):
        engine.score([[5, 6]], [3])
    with pytest.raises(ValueError, match="outside"):
        engine.score([[5, VOCAB]], [1])
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[5], []], GREEDY)


def test_load_weights(fresh_engine: HFEngine, reference: PreTrainedModel) -> None:
    seqs, lens = [[*p, 7, 8, 9] for p in PROMPTS], [len(p) for p in PROMPTS]
    before_tokens = [c.tokens for c in fresh_engine.generate(PROMPTS, GREEDY)]
    before_scores = fresh_engine.score(seqs, lens)

    generator = torch.Generator().manual_seed(1)
    perturbed = [
        (name, p.detach() + 0.3 * torch.randn(p.shape, generator=generator))
        for name, p in reference.named_parameters()
    ]
    # In several parts, as a trainer streaming its weights would.
    fresh_engine.load_weights(perturbed[:10])
    fresh_engine.load_weights(iter(perturbed[10:]))
    fresh_engine.set_version(3)
    assert fresh_engine.version == 3
    assert [c.tokens for c in fresh_engine.generate(PROMPTS, GREEDY)] != before_tokens
    after_scores = fresh_engine.score(seqs, lens)
    assert after_scores[0] != pytest.approx(before_scores[0], abs=1e-3)
    for name, p in fresh_engine.model.named_parameters():
        assert torch.equal(p, dict(perturbed)[name]), name
    # Tied weights stay tied: the output layer follows the loaded input embedding.
    assert (
        fresh_engine.model.get_output_embeddings().weight is fresh_engine.model.get_input_embeddings().weight
    )

    fresh_engine.load_weights(
        (name, p.detach().to(torch.float64)) for name, p in reference.named_parameters()
    )
    assert [c.tokens for c in fresh_engine.generate(PROMPTS, GREEDY)] == before_tokens
    assert fresh_engine.score(seqs, lens) == before_scores

    with pytest.raises(ValueError, match=re.escape("model.no_such.weight")):
        fresh_engine.load_weights([("model.no_such.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=re.escape("model.norm.weight")):
        fresh_engine.load_weights([("model.norm.weight", torch.zeros(31))])
    with pytest.raises(ValueError, match="version"):
        fresh_engine.set_version(-2)  # -1 is "no complete version"


def test_bad_model_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        HFEngine(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=re.escape(str(empty))):
        HFEngine(str(empty))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_new_tokens", 0),
        ("stop_token_ids", (3, -1)),
        ("seed", -1),
    ],
)
def test_sampling_params_validation(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_sampling_params_defaults() -> None:
    params = SamplingParams(stop_token_ids=[4, 5])  # type: ignore[arg-type]
    assert params.stop_token_ids == (4, 5)
    assert (params.temperature, params.top_k, params.top_p, params.max_new_tokens, params.seed) == (
        1.0,
        0,
        1.0,
        16,
        None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.seed = 3  # type: ignore[misc]


def test_interrupt_returns_partial_completions_that_continue(engine):
    """Interrupted rows come back early; continuing them from prompt + partial tokens completes them."""
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    full = engine.generate(prompts, params)
    calls = iter(range(100))
    partial = engine.generate(prompts, params, interrupt=lambda: next(calls) >= 1)  # stop after 2 tokens
    for f, p in zip(full, partial, strict=True):
        assert p.tokens == f.tokens[: len(p.tokens)] and len(p.tokens) <= 2
        if p.finish_reason == "interrupted":
            more = SamplingParams(temperature=0.0, max_new_tokens=6 - len(p.tokens))
            rest = engine.generate([prompts[full.index(f)] + p.tokens], more)[0]
            assert p.tokens + rest.tokens == f.tokens
    assert any(p.finish_reason == "interrupted" for p in partial)


def test_per_prompt_seeds_make_a_completion_independent_of_its_batch(engine: HFEngine) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    seeds = [11, 22, 33, 44]
    together = engine.generate(prompts, params, seeds=seeds)
    alone = [engine.generate([p], params, seeds=[s])[0] for p, s in zip(prompts, seeds, strict=True)]
    reordered = engine.generate(prompts[::-1], params, seeds=seeds[::-1])[::-1]
    assert [c.tokens for c in together] == [c.tokens for c in alone] == [c.tokens for c in reordered]
    other = engine.generate(prompts, params, seeds=[s + 1 for s in seeds])
    assert [c.tokens for c in other] != [c.tokens for c in together]


def test_counter_based_uniforms_are_uniform() -> None:
    import torch

    from meshrl.engines.hf import _uniform

    u = torch.cat([_uniform(torch.arange(20000, dtype=torch.int64) * 7919, step) for step in range(5)])
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.002
    assert len(torch.unique(u)) == len(u)


def test_rows_that_share_a_prompt_run_it_once_and_generate_as_alone(fresh_engine: HFEngine) -> None:
    """A group's rows (one prompt, several samples) take one row of the prefill each prompt; what each
    row generates is what it generates alone with its seed."""
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = [[5, 6, 7]] * 4 + [[8, 9]] * 3 + [[10, 11, 12, 13]]
    seeds = list(range(100, 108))
    batches: list[int] = []
    embed = fresh_engine.model.get_input_embeddings()
    hook = embed.register_forward_pre_hook(lambda _m, args: batches.append(args[0].shape[0]))
    try:
        together = fresh_engine.generate(prompts, params, seeds=seeds)
    finally:
        hook.remove()
    assert batches[0] == 3 and batches[1] == 8  # the distinct prompts, then every row decodes
    alone = [fresh_engine.generate([p], params, seeds=[s])[0] for p, s in zip(prompts, seeds, strict=True)]
    assert [c.tokens for c in together] == [c.tokens for c in alone]
    for a, b in zip(together, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({tuple(c.tokens) for c in together[:4]}) > 1  # the group's samples differ
