"""Vision-language models: images decoded and encoded once, then taken by the hf engine, the trainer's
forwards (packed or not) and the reference exactly as the processor made them (meshrl/models/vision.py)."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from PIL import Image

from meshrl.engines.base import SamplingParams
from meshrl.engines.fsdp import FSDPEngine
from meshrl.engines.hf import HFEngine
from meshrl.engines.packing import _packed_rows, pack
from meshrl.engines.settings import MemoryConfig, OptimConfig
from meshrl.envs import Environment, Limits, Message, State, Step, Turn, tool
from meshrl.envs.episode import advance, start
from meshrl.envs.parsers import PlainParser
from meshrl.envs.render import Renderer
from meshrl.models import pictures, vision
from meshrl.roles.reference.service import response_logprobs
from meshrl.roles.rollout.config import RolloutConfig
from meshrl.roles.rollout.data import encode

COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (230, 220, 30)]


def square(colour: tuple[int, int, int], size: int = 32) -> Image.Image:
    image = Image.new("RGB", (size, size), (255, 255, 255))
    image.paste(colour, (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    return image


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def question(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "colour?"}]}]  # fmt: skip


def cfg(model: Path, **kw) -> RolloutConfig:
    return RolloutConfig(model=str(model), dataset="rows.jsonl", rewards={"m:f": 1.0}, **kw)


def test_a_row_s_images_become_placeholders_and_pixels_whatever_form_they_come_in(vlm, processor):
    image = square(COLOURS[0])
    as_url = encode(processor, cfg(vlm), {"prompt": question(data_url(image))})
    listed = encode(processor, cfg(vlm), {"prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "colour?"}]}], "images": [image]})  # fmt: skip
    buf = io.BytesIO()
    image.save(buf, "PNG")
    as_datasets_value = encode(processor, cfg(vlm), {"prompt": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "colour?"}]}], "images": [{"bytes": buf.getvalue(), "path": None}]})  # fmt: skip
    for p in (as_url, listed, as_datasets_value):
        assert p.images is not None and p.images.pixels.shape == (1, 3, 32, 32)
        assert torch.equal(p.ids, as_url.ids) and torch.equal(p.images.pixels, as_url.images.pixels)
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((as_url.ids == image_id).sum()) == processor.image_seq_len  # expanded as the processor does


def test_pictures_travel_beside_the_pixels_and_prompts_collapse_to_one_placeholder_per_image(vlm, processor):
    """What the vLLM engine takes (tested against vLLM itself in `make test-vllm`): a row's pictures as
    they were decoded, exactly, and its prompt with each image's expansion back to one placeholder."""
    big, small = square(COLOURS[0]), Image.new("RGB", (20, 12), COLOURS[2])
    parts = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    ids, images = vision.encode(processor, [{"role": "user", "content": parts}], [big, small], "row 3")
    assert images is not None and [p.size for p in images.pictures] == [(32, 32), (20, 12)]
    packed = vision.columns([images, None], vision.blank(processor))
    assert set(packed) == {"images", "image_mask", "pictures"} and len(packed["pictures"][1]) == 0
    back = pictures.unpack(packed["pictures"][0])
    assert [p.tobytes() for p in back] == [big.tobytes(), small.tobytes()]

    placeholders = pictures.Placeholders(processor)
    compact = placeholders.collapse(ids.tolist(), images.pictures)
    token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert compact.count(token) == 2 and len(compact) == len(ids) - sum(
        len(placeholders.expansion(p)) - 1 for p in images.pictures
    )
    # the processor expands the compact prompt into ours again
    text = processor.tokenizer.decode(compact)
    again = processor(text=text, images=[images.pictures], add_special_tokens=False)["input_ids"][0]
    assert list(again) == ids.tolist()
    with pytest.raises(ValueError, match="does not hold the tokens of its image 2"):
        placeholders.collapse(ids.tolist(), [big, small, small])


def test_an_image_that_does_not_decode_or_is_too_large_or_meets_a_text_model_names_its_row(
    vlm, processor, tiny_model, tok
):
    with pytest.raises(ValueError, match=r"rows.jsonl: row 7: an image that does not decode"):
        encode(processor, cfg(vlm), {"prompt": question("data:image/png;base64,AAAA"), "_line": 7})
    with pytest.raises(ValueError, match=r"row 3: an image of 64x64 pixels is over the limit of 1000"):
        encode(
            processor,
            cfg(vlm, max_pixels=1000),
            {"prompt": question(data_url(square(COLOURS[1], 64))), "_line": 3},
        )
    with pytest.raises(
        ValueError, match="row 2: a row with images, for a model that is not a vision-language one"
    ):
        encode(tok, cfg(tiny_model), {"prompt": question(data_url(square(COLOURS[1]))), "_line": 2})
    with pytest.raises(ValueError, match="row 5: "):  # one placeholder, two images
        encode(
            processor,
            cfg(vlm),
            {"prompt": question(data_url(square(COLOURS[1]))), "images": [square(COLOURS[2])], "_line": 5},
        )


def prompts(processor, vlm, colours):
    out = [encode(processor, cfg(vlm), {"prompt": question(data_url(square(c)))}) for c in colours]
    return [p.ids.tolist() for p in out], [p.images for p in out]


def test_the_hf_engine_generates_from_the_image_and_stops_before_a_sampled_placeholder(vlm, processor):
    engine = HFEngine(str(vlm))
    ids, images = prompts(processor, vlm, COLOURS)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    seen = engine.generate(ids, greedy, images=images)
    blank = engine.generate(
        ids, greedy, images=[vision.Images(torch.zeros_like(i.pixels) + 1, i.mask) for i in images]
    )
    gap = max(
        abs(a - b)
        for s, t in zip(seen, blank, strict=True)
        for a, b in zip(s.logprobs, t.logprobs, strict=True)
    )
    assert gap > 1e-3  # the pixels reach the model
    # the same rows one at a time: a row's images follow it through batching
    alone = [engine.generate([p], greedy, images=[i])[0] for p, i in zip(ids, images, strict=True)]
    assert [c.tokens for c in alone] == [c.tokens for c in seen]
    assert torch.allclose(
        torch.tensor([c.logprobs for c in alone]), torch.tensor([c.logprobs for c in seen]), atol=1e-5
    )
    image_id = engine.model.config.image_token_id
    sampled = engine.generate(
        ids * 16, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0), images=images * 16
    )
    assert all(image_id not in c.tokens for c in sampled)


def test_the_trainer_and_the_reference_score_the_tokens_as_inference_sampled_them_packed_or_not(
    vlm, processor
):
    engine = HFEngine(str(vlm))
    ids, images = prompts(processor, vlm, COLOURS * 2)
    done = engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1), images=images)
    responses = [torch.tensor(c.tokens) for c in done]
    behaviour = [torch.tensor(c.logprobs) for c in done]
    batch = pack([torch.tensor(p) for p in ids], responses, behaviour, torch.ones(len(ids)), torch.ones(len(ids)),
                 images=images)  # fmt: skip
    trainer = FSDPEngine(str(vlm), OptimConfig(lr=1e-3), device=torch.device("cpu"))
    lp, _ = trainer.forward_logprobs(batch, 1.0)
    assert torch.allclose(lp[batch.mask], batch.old_logprobs[batch.mask], atol=1e-4)
    # samples packed two to a row (as token micro-batches pack them): each keeps its own images
    lengths = batch.attention_mask.sum(1).tolist()
    packed = _packed_rows(batch, [[3, 0], [1, 2], [4, 7], [6, 5]], lengths)
    plp, _ = trainer.forward_logprobs(packed, 1.0)
    order = [3, 0, 1, 2, 4, 7, 6, 5]
    expected = torch.cat([batch.old_logprobs[i][batch.mask[i]] for i in order])
    assert torch.allclose(plp[packed.mask], expected, atol=1e-4)
    from meshrl.dataplane import Ragged

    ref = response_logprobs(engine.model, Ragged.from_list([torch.tensor(p) for p in ids]), Ragged.from_list(responses),
                            images=images)  # fmt: skip
    assert torch.allclose(ref.values, torch.cat(behaviour), atol=1e-4)
    # without its images the same sequence scores differently: they are not decoration
    text_only = pack(
        [torch.tensor(p) for p in ids], responses, behaviour, torch.ones(len(ids)), torch.ones(len(ids))
    )
    lp_text, _ = trainer.forward_logprobs(text_only, 1.0)
    assert not torch.allclose(lp_text[batch.mask], batch.old_logprobs[batch.mask], atol=1e-2)


@pytest.mark.parametrize("train_vision", [False, True])
def test_the_vision_tower_is_frozen_unless_it_is_set_to_train(vlm, processor, train_vision):
    engine = HFEngine(str(vlm))
    ids, images = prompts(processor, vlm, COLOURS)
    done = engine.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=4, seed=2), images=images)
    batch = pack([torch.tensor(p) for p in ids], [torch.tensor(c.tokens) for c in done],
                 [torch.tensor(c.logprobs) for c in done], torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4),
                 images=images)  # fmt: skip
    trainer = FSDPEngine(str(vlm), OptimConfig(lr=1e-2), device=torch.device("cpu"), train_vision=train_vision,
                         memory=MemoryConfig(micro_batch=4))  # fmt: skip
    tower = vision.vision_tower(trainer.model)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.update_policy(batch)
    moved = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    tower_names = {f"model.vision_model.{n}" for n, _ in tower.named_parameters()}
    assert any(n.startswith("model.connector.") for n in moved) and any(".text_model." in n for n in moved)
    assert bool(moved & tower_names) == train_vision


def test_a_recipe_whose_services_disagree_on_the_model_family_or_engine_is_refused_at_start_up(
    vlm, tiny_model
):
    from meshrl.planning import prepare
    from meshrl.planning.config import RecipeError

    grpo, kl = (
        str(Path(__file__).resolve().parents[2] / "recipes" / r)
        for r in ("grpo_arith.py", "grpo_arith_kl.py")
    )
    with pytest.raises(RecipeError) as e:
        prepare(kl, [f"*.model={vlm}", f"trainer.model={tiny_model}", f"reference.model={tiny_model}"])
    assert [p.split(":")[0] for p in e.value.problems] == [
        "groups['trainer'].config.model",
        "groups['reference'].config.model",
    ]
    assert "is a text model, but rollout's model is a vision-language one" in e.value.problems[0]
    with pytest.raises(RecipeError) as e:
        prepare(grpo, [f"*.model={tiny_model}", f"inference.model={vlm}"])
    assert e.value.problems == [
        f"groups['inference'].config.model: {vlm} is a vision-language model, but rollout's model is a text one "
        "(it writes no images): give rollout the same model, whose processor encodes the prompts' images"
    ]
    with pytest.raises(RecipeError) as e:
        prepare(grpo, [f"*.model={vlm}", "inference.engine=sglang"])
    assert any(
        "the SGLang engine does not take yet; use the hf or vllm engine" in p for p in e.value.problems
    )
    prepare(grpo, [f"*.model={vlm}"])  # one family throughout: fine


@tool
def zoom(part: str) -> Image.Image:
    """A closer look at the picture.

    Args:
        part: which part, like centre
    """
    return square(COLOURS[2], 16)


class Look(Environment):
    """A picture in the question, and a tool that answers with another picture; with `again`, a first
    answer without a call gets a second picture and the question again (two turns, two pictures)."""

    tools = (zoom,)

    def __init__(self, again: bool = False) -> None:
        self.again = again

    async def reset(self, row: dict[str, Any]) -> tuple[list[Message], State]:
        image = square(COLOURS[int(row.get("colour", 0))])
        return [
            {
                "role": "user",
                "content": [{"type": "image", "image": image}, {"type": "text", "text": "colour?"}],
            }
        ], {"asked": 0}

    async def step(self, state: State, turn: Turn) -> Step:
        if turn.tool_calls or not self.again or state["asked"]:
            return await super().step(state, turn)
        state["asked"] = 1
        return Step([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(square(COLOURS[3]))}},
                                                  {"type": "text", "text": "and now?"}]}])  # fmt: skip

    async def reward(self, state: State, final: Turn | None, transcript: list[Message]) -> float:
        return float(final is not None and "r" in final.content)


def test_an_environment_s_pictures_and_a_tool_s_picture_follow_the_trajectory_s_tokens(vlm, processor):
    env = Look()
    env.limits = Limits(max_new_tokens=8, max_tokens=400)
    chat = Renderer(processor.tokenizer, PlainParser(["zoom"]), tool_role="user", processor=processor)
    tok = processor.tokenizer

    async def go() -> Any:
        ep = await start(env, chat, {"colour": 1})
        call = [*tok("zoom(centre)")["input_ids"], tok.eos_token_id]
        ep = await advance(env, chat, ep, call, [-0.1] * len(call), 0)
        answer = [*tok("red")["input_ids"], tok.eos_token_id]
        return await advance(env, chat, ep, answer, [-0.1] * len(answer), 1)

    ep = asyncio.run(go())
    t = ep.trajectory
    assert ep.done and ep.failed is None and ep.tool_calls == 1 and ep.reward == 1.0
    assert len(t.images) == 2 and t.image_segments == [2]  # the question's, then the tool's
    image_id = tok.convert_tokens_to_ids("<image>")
    assert t.ids.count(image_id) == 2 * processor.image_seq_len
    # the prompt built turn by turn on the tokens as generated is the whole conversation's rendering
    answer = len(tok("red")["input_ids"]) + 1
    assert t.ids[:-answer] == chat.prompt(ep.transcript[:3], [zoom.schema])
    assert torch.equal(
        vision.pixels(processor, t.images).pixels[1],
        vision.pixels(processor, [square(COLOURS[2], 16)]).pixels[0],
    )


def test_a_program_s_pictures_go_through_the_openai_endpoint_with_its_calls(vlm, processor, tok):
    from meshrl.envs.trajectory import join
    from meshrl.roles.agents.endpoint import Endpoint, Session
    from tests.unit.agents.test_endpoint import Scripted, client

    class Seeing(Scripted):
        def __init__(self, *a: Any) -> None:
            super().__init__(*a)
            self.images: list[list[str]] = []

        async def complete(self, ids, sampling, session, images):  # type: ignore[no-untyped-def]
            self.images.append(images)
            return await super().complete(ids, sampling, session, images)

    model = Seeing(processor.tokenizer, ["red", "blue"])
    renderer = Renderer(processor.tokenizer, PlainParser([]), tool_role="user", processor=processor)
    endpoint = Endpoint(renderer, model, names=("policy",), budget=200, max_new=8, call_timeout_s=5.0)
    session = endpoint.sessions["s"] = Session("s")
    first, second = data_url(square(COLOURS[0])), data_url(square(COLOURS[2]))

    async def program() -> None:
        c = client(endpoint)
        messages: list[dict] = question(first)
        a = await c.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": a.choices[0].message.content}, question(second)[0]]
        await c.chat.completions.create(model="policy", messages=messages)
        with pytest.raises(openai.BadRequestError, match="an image that does not decode"):
            await c.chat.completions.create(model="policy", messages=question("data:image/png;base64,AAAA"))
        text_only = Endpoint(Renderer(tok, PlainParser([])), model, names=("policy",), budget=200, max_new=8,
                             call_timeout_s=5.0)  # fmt: skip
        with pytest.raises(
            openai.BadRequestError, match="not a vision-language one: it takes no image parts"
        ):
            await client(text_only).chat.completions.create(model="policy", messages=question(first))

    asyncio.run(program())
    assert model.images == [[first], [first, second]]
    t = join(session.calls)
    assert t.images == [first, second] and t.image_segments == [2] and t.splits == 0  # the second call joined
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert t.ids.count(image_id) == 2 * processor.image_seq_len


def test_a_row_s_images_field_fills_its_placeholders_in_the_order_they_appear(vlm, processor):
    red, blue = square(COLOURS[0]), square(COLOURS[2])
    both = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": data_url(blue)}}]}]  # fmt: skip
    got = encode(processor, cfg(vlm), {"prompt": both, "images": [red]})
    alone = [encode(processor, cfg(vlm), {"prompt": question(data_url(c))}).images for c in (red, blue)]
    assert got.images is not None and torch.equal(got.images.pixels, torch.cat([a.pixels for a in alone]))
    with pytest.raises(
        ValueError, match=r"row 4: 1 of the 2 image\(s\) of its 'images' field have no placeholder"
    ):
        encode(processor, cfg(vlm), {"prompt": both, "images": [red, blue], "_line": 4})
