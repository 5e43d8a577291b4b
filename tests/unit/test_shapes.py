"""The shapes task: its pictures are drawn deterministically, each answer is what the picture shows, the
held-out pictures are not among the train ones, and the reward's edge cases."""

from __future__ import annotations

import pytest

from meshrl.models.vision import decode, split_messages
from meshrl.tasks import shapes


@pytest.fixture(scope="module")
def colour() -> tuple[list[dict], list[dict]]:
    return shapes.split(train_size=400, eval_size=100)


def test_rows_are_deterministic_from_the_seed(colour) -> None:
    assert shapes.split(train_size=400, eval_size=100) == colour
    assert shapes.generate(20, seed=3) == shapes.generate(20, seed=3)
    assert shapes.generate(20, seed=3) != shapes.generate(20, seed=4)
    assert shapes.generate(20, seed=3, kind="count") != shapes.generate(20, seed=3)


def test_held_out_pictures_are_not_train_pictures(colour) -> None:
    train, held_out = colour
    assert (len(train), len(held_out)) == (400, 100)
    pictures = {r["images"][0] for r in train}
    assert not pictures & {r["images"][0] for r in held_out}
    assert len({r["images"][0] for r in held_out}) == 100
    default_train, default_held = shapes.split()
    assert len(default_held) >= 100 and len(default_train) == shapes.TRAIN_SIZE
    assert not {r["images"][0] for r in default_train} & {r["images"][0] for r in default_held}


def pixels(row: dict) -> list[tuple[int, int, int]]:
    image = decode(row["images"][0], "test")
    assert image.size == (shapes.SIZE, shapes.SIZE)
    return list(image.get_flattened_data())


@pytest.mark.parametrize("kind", ["colour", "count"])
def test_the_answer_is_what_the_picture_shows(kind: str) -> None:
    for row in shapes.generate(200, seed=1, kind=kind):
        drawn = pixels(row)
        # the data URL is the picture its shapes describe, and every shape's colour is in it
        assert drawn == list(shapes.picture(row).get_flattened_data())
        counts = {name: drawn.count(rgb) for name, rgb in shapes.COLOURS.items()}
        present = {name for name, n in counts.items() if n}
        assert present == {s[1] for s in row["shapes"]}, row["shapes"]
        if kind == "colour":
            # the answer's colour covers more of the picture than any other
            assert row["answer"] == max(counts, key=counts.__getitem__)
            assert 1 <= len(row["shapes"]) <= 3
        else:
            assert row["answer"] == str(len(row["shapes"])) and 1 <= len(row["shapes"]) <= shapes.MAX_COUNT
            assert len(present) == len(row["shapes"])  # one colour each: the shapes can be told apart


def test_prompt_is_a_chat_with_one_image_part_for_the_images_field(colour) -> None:
    row = colour[0][0]
    messages, carried = split_messages(row["prompt"], "row 1", 10**6)
    assert carried == []  # the picture is in the images field, for the {"type": "image"} part
    assert messages[0]["content"][1] == {"type": "image"} and len(row["images"]) == 1
    assert [p["type"] for p in messages[0]["content"]] == ["text", "image"]  # the picture next to the answer
    # the question alone does not say: every row of a kind asks the same
    assert len({str(r["prompt"]) for r in colour[0]}) == 1


def test_chance_and_blank(colour) -> None:
    _, held_out = colour
    rate = shapes.chance(held_out)
    share = {a: sum(r["answer"] == a for r in held_out) / len(held_out) for a in shapes.COLOURS}
    assert rate == max(share.values())
    assert 1 / len(shapes.COLOURS) <= rate < 0.35
    blank = shapes.blank(held_out[0])
    assert blank["answer"] == held_out[0]["answer"] and blank["prompt"] == held_out[0]["prompt"]
    assert set(pixels(blank)) == {(255, 255, 255)}


@pytest.mark.parametrize("completion", ["red", "red<eos>", "red.", "red ", "red\n"])
def test_right_answers(completion: str) -> None:
    row = {"answer": "red"}
    assert shapes.correct(completion, row)
    assert shapes.reward(None, completion, row) == 1.0
    assert shapes.reward(None, [{"role": "assistant", "content": completion}], row) == 1.0


@pytest.mark.parametrize("completion", ["reddish", " red", "", "blue", "Red", "re", "red2"])
def test_wrong_answers(completion: str) -> None:
    row = {"answer": "red"}
    assert not shapes.correct(completion, row)
    assert shapes.reward(None, completion, row) == 0.0


def test_demonstrations_are_chat_rows_with_the_picture(colour) -> None:
    rows = colour[0][:3]
    demos = shapes.demonstrations(rows)
    for demo, row in zip(demos, rows, strict=True):
        assert demo["messages"][:-1] == row["prompt"]
        assert demo["messages"][-1] == {"role": "assistant", "content": row["answer"]}
        assert demo["images"] == row["images"]


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        shapes.generate(1, seed=0, kind="texture")
