"""The training engine's packing, schedule and update step (one process, world size 1)."""

from __future__ import annotations

import math

import pytest
import torch

from meshrl.engines.fsdp import FSDPEngine
from meshrl.engines.optim import OptimConfig, lr_factor
from meshrl.engines.packing import pack, token_micro_batches
from meshrl.engines.settings import LoraConfig, LossConfig, MemoryConfig, ValueHeadConfig
from meshrl.roles.trainer.config import TrainerConfig

MEMORY = {f for f in MemoryConfig.__dataclass_fields__}


def Step(epochs: int = 1, **kw: object) -> dict[str, object]:
    """update_policy's settings: the loss section's fields as given, a value head with value_*."""
    value = {k.removeprefix("value_"): kw.pop(k) for k in list(kw) if k.startswith("value_")}
    return {"loss": LossConfig(**kw), "value": ValueHeadConfig(**value), "epochs": epochs}  # type: ignore[arg-type]


def engine_with(tiny_model, lr: float = 1e-2, **kw) -> FSDPEngine:
    """An engine on CPU; MemoryConfig's fields (micro-batches of 3 rows unless given) go to its memory."""
    memory = MemoryConfig(**{"micro_batch": 3, **{k: kw.pop(k) for k in list(kw) if k in MEMORY}})
    return FSDPEngine(str(tiny_model), OptimConfig(lr=lr), device=torch.device("cpu"), memory=memory, **kw)


def test_pack_aligns_response_values_with_the_positions_that_predict_them():
    b = pack(
        [torch.tensor([5, 6]), torch.tensor([7])],
        [torch.tensor([8, 9, 1]), torch.tensor([2])],
        [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4])],
        torch.tensor([1.0, -2.0]),
        torch.tensor([True, False]),
    )
    assert b.input_ids.tolist() == [[5, 6, 8, 9, 1], [7, 2, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # position t predicts token t+1: row 0's response starts at position 1
    assert b.mask.tolist() == [[False, True, True, True], [False, False, False, False]]  # invalid row masked
    assert b.old_logprobs[0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert b.advantages.tolist() == [1.0, 0.0]


def test_schedules():
    cfg = OptimConfig(lr=1.0, warmup_steps=2, schedule="linear")
    assert [lr_factor(s, cfg, 12) for s in (0, 1, 2, 7, 12)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    cos = OptimConfig(lr=1.0, schedule="cosine")
    assert lr_factor(5, cos, 10) == pytest.approx(0.5) and lr_factor(0, OptimConfig(lr=1.0), 1) == 1.0


def batch(n: int = 6):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 14, (3,), generator=g) for _ in range(n)]
    responses = [torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(1, 4, (n,), generator=g)]
    return pack(
        prompts,
        responses,
        [torch.zeros(len(r)) for r in responses],
        torch.randn(n, generator=g),
        torch.ones(n),
    )


def params(engine: FSDPEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.get_weights()]


def test_update_moves_weights_and_reports_metrics(tiny_model):
    engine = engine_with(tiny_model, lr=1e-2)
    before = params(engine)
    stats = engine.update_policy(batch(), epochs=2)
    assert stats["nan_skipped"] == 0 and math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    assert engine.steps == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))


def test_non_finite_loss_skips_the_update(tiny_model):
    engine = engine_with(tiny_model, lr=1e-2)
    before = params(engine)
    bad = batch()
    bad.advantages[0] = float("nan")
    stats = engine.update_policy(bad)
    assert stats["nan_skipped"] == 1 and engine.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_a_step_without_tokens_is_not_a_non_finite_one_and_leaves_the_weights(tiny_model, policy_loss):
    """Every sample of the step failed to score: its loss is 0, not 0 / 0, and nothing moves."""
    engine = engine_with(tiny_model, lr=1e-2)
    before = params(engine)
    empty = batch()
    empty.mask = torch.zeros_like(empty.mask)
    stats = engine.update_policy(empty, LossConfig(policy=policy_loss))
    assert stats["nan_skipped"] == 0 and stats["loss"] == 0.0 and engine.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, params(engine), strict=True))


def test_pack_spreads_per_token_advantages_and_critic_columns():
    from meshrl.dataplane import Ragged

    b = pack(
        [torch.tensor([5, 6]), torch.tensor([7])],
        [torch.tensor([8, 9]), torch.tensor([2])],
        None,
        Ragged.from_list([torch.tensor([0.5, -0.5]), torch.tensor([2.0])]),
        torch.tensor([True, True]),
        values=Ragged.from_list([torch.tensor([0.1, 0.2]), torch.tensor([0.3])]),
        returns=Ragged.from_list([torch.tensor([1.0, 1.0]), torch.tensor([0.0])]),
    )
    assert b.advantages.tolist() == [[0.0, 0.5, -0.5], [2.0, 0.0, 0.0]]
    assert b.values is not None
    torch.testing.assert_close(b.values, torch.tensor([[0.0, 0.1, 0.2], [0.3, 0.0, 0.0]]))
    assert b.old_logprobs.abs().sum() == 0


def test_value_head_learns_returns_that_depend_on_the_tokens(tiny_model):
    from meshrl.engines.value import ValueEngine

    memory = MemoryConfig(micro_batch=4)
    engine = ValueEngine(
        str(tiny_model), OptimConfig(lr=3e-3), device=torch.device("cpu"), memory=memory, head="value"
    )
    b = batch(12)
    # the return of a position is 1 when the token just read is even: the critic must read the tokens
    b.returns = torch.where(b.mask, (b.input_ids[:, :-1] % 2 == 0).float(), 0.0)
    b.values = engine.compute_values(b, micro_batch=4)
    assert b.values.shape == b.mask.shape
    first = engine.update_value(b, clip=None)
    for _ in range(30):
        last = engine.update_value(b, clip=None)
    assert last["value_loss"] < 0.2 * first["value_loss"], (first, last)
    values = engine.compute_values(b, micro_batch=6)[b.mask]
    returns = b.returns[b.mask]
    assert (values[returns == 1].mean() - values[returns == 0].mean()).item() > 0.7


def test_checkpoint_round_trip_restores_model_optimizer_and_step(tiny_model, tmp_path):
    engine = engine_with(tiny_model, lr=1e-2)
    engine.update_policy(batch())
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    saved = params(engine)
    engine.update_policy(batch())  # moves away from the checkpoint
    fresh = engine_with(tiny_model, lr=1e-2)
    fresh.load_checkpoint(str(tmp_path / "ckpt"))
    assert fresh.steps == 1
    for a, b in zip(params(fresh), saved, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the optimizer state came back too: the next step from the checkpoint is the same on both
    again = engine_with(tiny_model, lr=1e-2)
    again.load_checkpoint(str(tmp_path / "ckpt"))
    fresh.update_policy(batch())
    again.update_policy(batch())
    for a, b in zip(params(fresh), params(again), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fresh.optimizer.state_dict()["state"][0]["step"] == 2


def test_actor_critic_learns_values_with_the_policy_and_publishes_only_the_policy(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from meshrl.engines.checkpoints import VALUE_HEAD_FILE

    plain = engine_with(tiny_model, lr=3e-3)
    engine = engine_with(tiny_model, lr=3e-3, head="lm+value")
    # inference receives exactly the policy's tensors: the value head stays in the trainer
    assert engine.manifest() == plain.manifest()
    assert len(list(engine.get_weights())) == len(engine.manifest())
    b = batch(12)
    b.returns = torch.where(b.mask, (b.input_ids[:, :-1] % 2 == 0).float(), 0.0)
    b.values = engine.compute_values(b, micro_batch=5)
    assert b.values.shape == b.mask.shape and b.values.abs().max() == 0  # a fresh head starts at 0
    cfg = Step(value_head=True, value_coef=1.0, value_clip=None)
    first = engine.update_policy(b, **cfg)
    for _ in range(30):
        b.values = engine.compute_values(b, micro_batch=5)
        last = engine.update_policy(b, **cfg)
    assert last["value_loss"] < 0.2 * first["value_loss"], (first, last)
    assert last["loss"] == pytest.approx(last["pg_loss"] + last["value_loss"], rel=1e-6)
    values = engine.compute_values(b, micro_batch=12)[b.mask]
    returns = b.returns[b.mask]
    assert (values[returns == 1].mean() - values[returns == 0].mean()).item() > 0.5
    # the training forward and the values-only forward (one position of logits) agree
    _, _, _, trained = engine._policy_forward(b, 1.0)
    assert trained is not None
    torch.testing.assert_close(trained[b.mask].detach(), values, rtol=1e-5, atol=1e-5)
    # saved: an HF causal LM that loads on its own, plus the head, which a new engine picks up
    engine.save_pretrained(str(tmp_path / "final"))
    assert (tmp_path / "final" / VALUE_HEAD_FILE).exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final") is not None
    again = FSDPEngine(
        str(tmp_path / "final"), OptimConfig(lr=1e-3), device=torch.device("cpu"), head="lm+value"
    )
    torch.testing.assert_close(again.compute_values(b, micro_batch=4)[b.mask], values, rtol=1e-5, atol=1e-5)


def varied(n: int = 10):
    """Rows of very different lengths (prompts of 2-4 tokens, responses of 1-9), per-row advantages."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(2, 5, (n,), generator=g)]
    responses = [
        torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(1, 10, (n,), generator=g)
    ]
    logprobs = [-torch.rand(len(r), generator=g) for r in responses]
    return pack(prompts, responses, logprobs, torch.randn(n, generator=g), torch.ones(n))


def update_grads(engine: FSDPEngine, b, cfg: dict) -> tuple[dict[str, float], list[torch.Tensor]]:
    """One update's metrics and the gradients its optimizer step saw (before clipping)."""
    seen: list[torch.Tensor] = []
    step = engine._step

    def capture(**kw):
        seen.extend(p.grad.clone() for p in engine.model.parameters() if p.requires_grad)
        return step(**kw)

    engine._step = capture  # type: ignore[method-assign]
    return engine.update_policy(b, **cfg), seen


def assert_same_update(a: tuple, b: tuple, tol: float) -> None:
    for key in ("loss", "pg_loss", "entropy", "kl_behaviour", "clip_fraction"):
        assert a[0][key] == pytest.approx(b[0][key], rel=tol, abs=tol), key
    for x, y in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_chunked_logprobs_give_the_loss_and_gradients_of_the_whole_logits(tiny_model):
    cfg = Step(entropy_coef=0.1)
    whole = update_grads(engine_with(tiny_model, logits_chunk=0, micro_batch=4), varied(), cfg)
    engine = engine_with(tiny_model, logits_chunk=5, micro_batch=4)
    assert engine._chunked  # the tiny Qwen2's logits are its output projection: chunks apply
    chunked = update_grads(engine, varied(), cfg)
    assert_same_update(chunked, whole, 1e-6)


def test_on_policy_gradient_is_the_token_mean_of_advantage_weighted_log_prob_gradients(tiny_model):
    """The whole objective, checked against its definition on a plain HF model: on-policy (ratio 1, no
    clipping), the update's gradient is -(1/N) sum over the N response tokens of A_row * grad log p, the
    gradient TRL's default GRPO loss ("dapo") gives with the same advantages."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(2)
    n = 7
    prompts = [torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(2, 6, (n,), generator=g)]
    responses = [torch.randint(4, 14, (int(k),), generator=g) for k in torch.randint(1, 9, (n,), generator=g)]
    advantages = torch.randn(n, generator=g)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokens = sum(len(r) for r in responses)
    behaviour = []
    for p, r, a in zip(prompts, responses, advantages, strict=True):
        logits = ref(torch.cat([p, r])[None]).logits[0, len(p) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None]).squeeze(-1)
        (-(a * logp).sum() / tokens).backward()
        behaviour.append(logp.detach())
    b = pack(prompts, responses, behaviour, advantages, torch.ones(n))
    metrics, grads = update_grads(engine_with(tiny_model, micro_batch=3), b, Step())
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    expected = [p.grad for p in ref.parameters()]
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_packed_micro_batches_give_the_loss_and_gradients_of_unpacked_ones(tiny_model):
    b = varied(12)
    micro = token_micro_batches(b, max_tokens=30)
    widths = b.attention_mask.sum(1)
    assert sum(int(m.attention_mask.sum()) for m in micro) == int(widths.sum())  # every token, no padding
    assert all(m.input_ids.numel() <= max(30, int(widths.max())) for m in micro)
    assert any(m.position_ids is not None and (m.position_ids[:, 1:] == 0).any() for m in micro)  # packed
    assert sum(int(m.mask.sum()) for m in micro) == int(b.mask.sum())
    rows = update_grads(engine_with(tiny_model, micro_batch=4), b, Step())
    packed = update_grads(engine_with(tiny_model, max_tokens_per_micro_batch=30), b, Step())
    assert_same_update(packed, rows, 1e-5)


def test_activation_checkpointing_changes_nothing_but_memory(tiny_model):
    plain = update_grads(engine_with(tiny_model), varied(), Step())
    ckpt = update_grads(engine_with(tiny_model, activation_checkpointing=True), varied(), Step())
    assert_same_update(ckpt, plain, 1e-6)


def test_bf16_mixed_keeps_fp32_master_state_and_learns(tiny_model):
    engine = engine_with(tiny_model, lr=3e-3, precision="bf16-mixed", micro_batch=4)
    b = varied(12)
    b.advantages = torch.where(torch.arange(12) % 2 == 0, 1.0, -1.0)
    first = engine.update_policy(b)
    for _ in range(5):
        last = engine.update_policy(b)
    assert last["pg_loss"] < first["pg_loss"] - 0.05, (first["pg_loss"], last["pg_loss"])
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    state = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert state and all(v.dtype == torch.float32 for v in state)
    # inference receives the weights the trainer computes with: bfloat16
    assert {d for _, _, d in engine.manifest()} == {"bfloat16"}
    assert all(t.dtype == torch.bfloat16 for t in engine.get_weights())


def test_lora_trains_only_the_adapters_and_publishes_merged_weights(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    plain = engine_with(tiny_model)
    engine = engine_with(tiny_model, lora=LoraConfig(rank=4, save_merged=True))
    assert engine.manifest() == plain.manifest()  # inference sees a plain model
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in engine.optimizer.param_groups) == len(trainable)
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    before = params(engine)
    assert all(torch.equal(a, b) for a, b in zip(before, params(plain), strict=True))  # B starts at 0
    engine.update_policy(varied())
    engine.update_policy(varied())
    assert all(torch.equal(p, frozen[n]) for n, p in engine.model.named_parameters() if not p.requires_grad)
    after = params(engine)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the final save: the adapter, and the merged model, which scores as the trainer does
    engine.save_pretrained(str(tmp_path / "final"), source=str(tiny_model))
    assert (tmp_path / "final" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final" / "merged")
    for (name, _, _), t in zip(engine.manifest(), after, strict=True):
        torch.testing.assert_close(merged.get_parameter(name), t)
    engine.save_checkpoint(str(tmp_path / "ckpt"))  # adapters and their optimizer state only
    saved = sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir())
    assert saved < sum(p.numel() * 4 for p in frozen.values()) / 2
    resumed = engine_with(tiny_model, lora=LoraConfig(rank=4))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.steps == 2 and all(torch.equal(a, b) for a, b in zip(params(resumed), after, strict=True))


def test_lora_published_alone_is_a_peft_adapter_whose_merge_is_the_merged_publication(tiny_model):
    """publish_adapters (for vLLM): the adapter matrices under PEFT's saved names (in the compute dtype);
    PEFT loads them, and their merge into the base is what the merged publication carries."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(rank=4, alpha=8.0)
    engine = engine_with(tiny_model, lora=lora, publish_adapters=True)
    merged = engine_with(tiny_model, lora=lora)
    for _ in range(3):
        engine.update_policy(varied())
    merged.model.load_state_dict(engine.model.state_dict())
    names = [n for n, _, _ in engine.manifest()]
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    bf16 = engine_with(tiny_model, lora=lora, publish_adapters=True, precision="bf16-mixed")
    assert [n for n, _, _ in bf16.manifest()] == names and {d for _, _, d in bf16.manifest()} == {"bfloat16"}
    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    plain = {n: p.detach().clone() for n, p in base.named_parameters()}
    peft = get_peft_model(base, PeftLora(r=4, lora_alpha=8.0, target_modules="all-linear"))
    result = set_peft_model_state_dict(peft, dict(zip(names, engine.get_weights(), strict=True)))
    assert not [k for k in result.unexpected_keys if ".lora_" in k]
    mine = peft.merge_and_unload().state_dict()
    moved = 0.0
    for (name, _, _), t in zip(merged.manifest(), merged.get_weights(), strict=True):
        torch.testing.assert_close(mine[name], t, rtol=0, atol=1e-6)
        moved = max(moved, float((t - plain[name]).abs().max()))
    assert moved > 1e-3  # the adapters did change the model


@pytest.mark.parametrize(
    ("kw", "dtype", "tolerance"),
    [({"lora": LoraConfig(rank=4)}, "float32", 1e-5), ({"precision": "bf16-mixed"}, "bfloat16", 0.05)],
)
def test_inference_scores_as_the_trainer_after_updates(tiny_model, kw, dtype, tolerance):
    """LoRA: inference gets the merged weights; bf16-mixed: a bf16 inference model gets the bf16
    weights and agrees with the trainer's autocast forward to about bf16's precision."""
    from meshrl.engines.hf import HFEngine
    from tests.integration.engine_checks import check_versions, direct

    engine = HFEngine(str(tiny_model), loader_kwargs={"dtype": getattr(torch, dtype)})
    check_versions(engine, tiny_model, direct, tolerance=tolerance, **kw)


def test_packing_precision_and_lora_settings_are_checked_at_load_time():
    from meshrl.planning.config import RecipeError

    packed = MemoryConfig(max_tokens_per_micro_batch=64, precision="bf16-mixed")
    TrainerConfig(model=".", memory=packed, lora=LoraConfig(rank=8))
    for field, bad in (
        (
            "max_tokens_per_micro_batch",
            dict(loss=LossConfig(aggregation="seq-mean-token-mean")),
        ),  # per-row terms
        ("max_tokens_per_micro_batch", dict(loss=LossConfig(policy="gspo"))),
        ("loader_kwargs", dict(loader_kwargs={"dtype": "bfloat16"}, memory=MemoryConfig())),
        ("lora", dict(lora=LoraConfig(rank=8), value=ValueHeadConfig(head=True), memory=MemoryConfig())),
    ):
        with pytest.raises(RecipeError, match=field):
            TrainerConfig(model=".", **{"memory": packed, **bad})  # type: ignore[arg-type]


def test_a_sample_in_segments_trains_as_its_segments_would_apart(tiny_model):
    """An agent's trajectory whose history was rewritten is one sample in two segments: positions
    restart at the second and no token attends across, so (token-mean) its loss and gradients are those
    of the two segments as samples of their own, under the same advantage."""
    from meshrl.dataplane import Ragged

    p1, r1, p2, r2 = (torch.tensor(x) for x in ([5, 6, 7], [8, 9], [10, 11, 12, 13], [4, 6, 8]))
    lp1, lp2 = torch.tensor([-0.5, -0.7]), torch.tensor([-0.2, -0.9, -1.1])
    whole = pack(
        [p1], [torch.cat([r1, p2, r2])], [torch.cat([lp1, torch.zeros(4), lp2])], torch.tensor([0.7]),
        torch.ones(1), loss_mask=Ragged.from_list([torch.tensor([1, 1, 0, 0, 0, 0, 1, 1, 1])]),
        segments=Ragged.from_list([torch.tensor([5, 7])]),
    )  # fmt: skip
    assert whole.position_ids is not None and whole.position_ids[0].tolist() == [
        0,
        1,
        2,
        3,
        4,
        0,
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    apart = pack([p1, p2], [r1, r2], [lp1, lp2], torch.tensor([0.7, 0.7]), torch.ones(2))
    one = update_grads(engine_with(tiny_model, micro_batch=4), whole, Step())
    two = update_grads(engine_with(tiny_model, micro_batch=4), apart, Step())
    assert_same_update(one, two, 1e-5)
