"""`meshrl sft` on image chat rows, with the tiny vision-language model: the processor expands every image
placeholder, the loss covers the assistant's tokens only, the pixels ride with their rows into the
engine's batches, the vision tower stays frozen unless --train-vision, and rows it cannot use are errors
naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshrl.cli import main as cli
from meshrl.commands.chat_data import DataError, encode, row_of, to_batch
from meshrl.models import vision
from meshrl.tasks import shapes


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return shapes.generate(48, seed=5)


def write(path: Path, rows: list[object] | list[str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def forms(row: dict) -> list[dict]:
    """The same conversation with its picture as an `images` field, an OpenAI image_url part and an image
    part holding the picture."""
    url, question, answer = row["images"][0], row["prompt"][0]["content"][0], row["answer"]
    reply = {"role": "assistant", "content": answer}
    return [
        shapes.demonstrations([row])[0],
        {
            "messages": [
                {"role": "user", "content": [question, {"type": "image_url", "image_url": {"url": url}}]},
                reply,
            ]
        },
        {"messages": [{"role": "user", "content": [question, {"type": "image", "image": url}]}, reply]},
    ]


def test_image_rows_mask_the_assistant_and_carry_their_pixels(processor, rows) -> None:
    tok = processor.tokenizer
    examples = [
        encode(tok, row_of(r, f"row {i}"), 128, processor=processor) for i, r in enumerate(forms(rows[0]))
    ]
    first = examples[0]
    for e in examples:
        assert e.ids == first.ids and e.mask == first.mask and e.images is not None
        assert torch.equal(e.images.pixels, first.images.pixels) and e.images.pixels.shape == (1, 3, 32, 32)
    image_id = tok.convert_tokens_to_ids("<image>")
    assert first.ids.count(image_id) == processor.image_seq_len  # expanded as the processor expands it
    assert (
        tok.decode([t for t, m in zip(first.ids, first.mask, strict=True) if m])
        == f"{rows[0]['answer']}<eos>"
    )
    image = (
        "<fake_token_around_image><global-img>"
        + "<image>" * processor.image_seq_len
        + "<fake_token_around_image>"
    )
    assert (
        tok.decode(first.ids)
        == f"<|user|>colour of the largest shape?{image}<|assistant|>{rows[0]['answer']}<eos>"
    )

    # a text row beside image rows: its entry is None, the image rows' pixels stay in row order
    text = encode(tok, row_of({"prompt": "1+1=", "completion": "2"}, "row 9"), 128, processor=processor)
    second = encode(tok, row_of(shapes.demonstrations([rows[1]])[0], "row 2"), 128, processor=processor)
    batch = to_batch([first, text, second], tok.pad_token_id)
    assert batch.images is not None and batch.images[1] is None
    assert batch.images[0] is first.images and batch.images[2] is second.images
    assert tok.decode(batch.input_ids[0, 1:][batch.mask[0]]) == f"{rows[0]['answer']}<eos>"

    # a cut inside the image's tokens falls before them, and the image is left out
    cut = encode(tok, row_of(shapes.demonstrations([rows[0]])[0], "row 1"), 5, processor=processor)
    assert cut.truncated and image_id not in cut.ids and cut.images is None and sum(cut.mask) == 0


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"images": []}, "line 2: more image placeholders than the 0 image(s) of its 'images' field"),
        ({"images": [shapes.generate(1, seed=0)[0]["images"][0]] * 2}, "line 2: 1 of the 2 image(s) of its 'images' field have no placeholder"),
        ({"images": ["data:image/png;base64,bm90IGFuIGltYWdl"]}, "line 2: an image that does not decode"),
        ({"images": ["data:image/png,raw"]}, "line 2: an image that does not decode (a data URL that is not base64)"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "line 2: tools and images in one row"),
    ],
)  # fmt: skip
def test_bad_image_rows_are_errors_naming_the_line(
    vlm: Path,
    rows: list[dict],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    change: dict,
    expected: str,
) -> None:
    demos = shapes.demonstrations(rows[:2])
    data = write(tmp_path / "bad.jsonl", [demos[0], {**demos[1], **change}])
    with pytest.raises(SystemExit) as exit_:
        cli(["sft", "--model", str(vlm), "--data", str(data), "--out", str(tmp_path / "o")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "meshrl sft: error:" in err and expected in err, err
    assert not (tmp_path / "o").exists()


def test_an_image_over_the_limit_and_images_for_a_text_model_are_errors(
    vlm: Path, tiny_model: Path, rows: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write(tmp_path / "rows.jsonl", shapes.demonstrations(rows[:2]))
    for model, extra, expected in (
        (vlm, ["--max-pixels", "1000"], "line 1: an image of 32x32 pixels is over the limit of 1000 (max_pixels: rollout.max_pixels in a run, --max-pixels in meshrl sft)"),
        (tiny_model, [], "line 1: a row with images, for a text model (no vision tower)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            cli(["sft", "--model", str(model), "--data", str(data), "--out", str(tmp_path / "o"), *extra])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert expected in err, err
    with pytest.raises(DataError, match="row 4: a row with images, for a text model"):
        encode(
            vision.load_processor(str(vlm)).tokenizer, row_of(shapes.demonstrations(rows[:1])[0], "row 4"), 64
        )


@pytest.mark.parametrize("train_vision", [False, True])
def test_sft_on_image_rows_learns_and_writes_a_model_transformers_runs(
    vlm: Path, rows: list[dict], tmp_path: Path, train_vision: bool
) -> None:
    from meshrl.commands import sft

    data, out = write(tmp_path / "rows.jsonl", shapes.demonstrations(rows)), tmp_path / "sft"
    argv = ["--model", str(vlm), "--data", str(data), "--out", str(out), "--steps", "8", "--batch", "16",
            "--eval-fraction", "0.25", "--threads", "1", "optim.lr=3e-3", "memory.micro_batch=16",
            *(["--train-vision"] if train_vision else [])]  # fmt: skip
    threads = torch.get_num_threads()
    try:
        result = sft.train(sft.load(argv))
    finally:
        torch.set_num_threads(threads)
    assert result is not None and result["sequences"] == 36 and result["held_out_sequences"] == 12
    # measured 3.92 -> 2.41 (the answers' form: colour names; which colour takes longer)
    assert result["held_out_loss_after"] < 0.75 * result["held_out_loss_before"], result
    assert result["nan_skipped"] == 0

    trained, base = vision.load_model(str(out)), vision.load_model(str(vlm))
    tower = {k: v for k, v in base.state_dict().items() if "vision_model." in k}
    assert tower
    changed = {k for k, v in trained.state_dict().items() if k in tower and not torch.equal(v, tower[k])}
    assert bool(changed) is train_vision  # frozen unless --train-vision
    assert any(
        not torch.equal(v, base.state_dict()[k]) for k, v in trained.state_dict().items() if k not in tower
    )

    processor = vision.load_processor(str(out))  # the processor files travel with the model
    messages, _ = vision.split_messages(rows[0]["prompt"], "", 10**6)
    ids, images = vision.encode(processor, messages, [vision.decode(rows[0]["images"][0], "")], "")
    generated = trained.generate(
        ids[None], **vision.model_inputs([images]), max_new_tokens=3, do_sample=False
    )
    assert generated.shape[1] > len(ids)
