"""A vision-language model through a real run: rollout encodes each row's images once, inference generates
from them, the reference and the trainer (packed micro-batches) score the same tokens with the same
pixels, and the final folder is a model and processor that plain transformers loads and runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.grpo.test_grpo import REPO, rows, run
from tests.unit.test_vision import COLOURS, data_url, question, square

NAMES = ("red", "green", "blue", "yellow")


def reward(prompt, completion, row) -> float:
    """1 when the answer starts with the square's colour (a chat completion: the assistant's message), and
    a little for every character: an untrained model's completions then differ in reward, and it learns."""
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return float(text.strip().startswith(row["answer"])) + 0.1 * len(text)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Colour questions about a square, the image in the message as a data URL; line 5 holds an image
    that does not decode and line 9 a question without an image."""
    path = tmp_path_factory.mktemp("data") / "colours.jsonl"
    lines = []
    for i in range(40):
        k = i % 4
        prompt = question(data_url(square(COLOURS[k])))
        if i == 4:
            prompt = question("data:image/png;base64,bm90IGFuIGltYWdl")
        if i == 8:
            prompt = [{"role": "user", "content": "colour?"}]
        lines.append(json.dumps({"prompt": prompt, "answer": NAMES[k]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_vision_language_model_trains_through_the_mesh_and_its_final_folder_runs_in_transformers(
    tmp_path, dataset
):
    from meshrl.models.tiny import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm")
    run_dir = tmp_path / "run"
    done = run(
        tmp_path, f"*.model={model}", f"rollout.dataset={dataset}", f"run_dir={run_dir}", "total_steps=3",
        "prompts_per_step=4", "group_size=4", "trainer.mini_batches=1", "rollout.eval_every=0",
        "inference.max_new_tokens=6", 'rollout.rewards={"tests.integration.test_vlm:reward": 1.0}',
        "trainer.memory.max_tokens_per_micro_batch=256",
        recipe=str(REPO / "recipes" / "grpo_arith_kl.py"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    # the trainer's log-probs of step 0 are inference's, and the reference's: all saw the same pixels
    assert metrics[0]["kl_behaviour"] < 1e-6 and metrics[0]["kl_ref"] < 1e-6
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rollout-*.log"))
    assert "row 5: an image that does not decode" in logs  # skipped, with its reason

    from transformers import AutoModelForImageTextToText

    from meshrl.models import vision

    final = run_dir / "final"
    processor = vision.load_processor(str(final))
    trained = AutoModelForImageTextToText.from_pretrained(final)
    ids, images = vision.encode(
        processor, *vision.split_messages(question(data_url(square(COLOURS[2]))), "", 10**6), ""
    )
    assert images is not None
    out = trained.generate(ids[None], **vision.model_inputs([images]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > len(ids)
    base = AutoModelForImageTextToText.from_pretrained(model)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(trained.state_dict().values(), base.state_dict().values(), strict=True)
    )


def test_an_agent_s_pictures_reach_inference_and_the_trainer_turn_after_turn(tmp_path):
    from meshrl.models.tiny import build_tiny_vlm

    model = build_tiny_vlm(tmp_path / "vlm")
    data = tmp_path / "looks.jsonl"
    data.write_text("".join(json.dumps({"prompt": "look", "colour": i % 4}) + "\n" for i in range(16)))
    run_dir = tmp_path / "run"
    done = run(
        tmp_path, f"*.model={model}", f"rollout.dataset={data}", f"run_dir={run_dir}", "total_steps=2",
        "prompts_per_step=4", "group_size=4", "trainer.mini_batches=1", "agents.environment=tests.unit.test_vision:Look",
        'agents.args={"again": true}', "agents.parser=plain", "agents.max_tokens=200", "inference.max_new_tokens=6",
        recipe=str(REPO / "recipes" / "agent_calc.py"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert metrics[0]["agent/turns_mean"] >= 1.5  # most trajectories hold two pictures, one per turn
    # every turn was generated from its pictures, and the trainer scores the whole trajectory with them
    assert metrics[0]["kl_behaviour"] < 1e-6


def test_a_critic_of_a_vision_language_model_reads_the_pixels_and_its_folder_loads_again(
    tmp_path, vlm, dataset
):
    """PPO with a separate critic: the critic is the model with a value head on its last hidden state
    (transformers has no token classifier of the family), reads the prompts' pixels as the trainer does,
    learns, and saves the model and its value head, which a critic loads again."""
    from meshrl.engines.packing import pack
    from meshrl.engines.settings import OptimConfig
    from meshrl.engines.value import ValueEngine
    from meshrl.models import vision

    run_dir = tmp_path / "run"
    done = run(
        tmp_path, f"*.model={vlm}", f"rollout.dataset={dataset}", f"run_dir={run_dir}", "total_steps=2",
        "prompts_per_step=4", "group_size=2", "critic.mini_batches=1", "rollout.eval_every=0",
        "inference.max_new_tokens=6", 'rollout.rewards={"tests.integration.test_vlm:reward": 1.0}',
        "critic.optim.lr=1e-2", recipe=str(REPO / "recipes" / "ppo_arith.py"),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    critic = rows(run_dir / "critic.jsonl")
    assert [c["version"] for c in critic] == [1, 2] and all(c["value_loss"] > 0 for c in critic)
    saved = run_dir / "critic"
    assert (saved / "value_head.safetensors").exists() and vision.is_vision(str(saved))

    processor = vision.load_processor(str(saved))
    ids, images = vision.encode(
        processor, *vision.split_messages(question(data_url(square(COLOURS[1]))), "", 10**6), ""
    )
    blank = vision.Images(torch.zeros_like(images.pixels) + 1, images.mask)  # all zeros: padding to Idefics3
    values = {}
    for name, pixels in (("seen", images), ("blank", blank)):
        engine = ValueEngine(str(saved), OptimConfig(), device=torch.device("cpu"), head="value")
        batch = pack([ids], [torch.tensor([5, 6])], None, torch.zeros(1), torch.ones(1, dtype=torch.bool),
                     images=[pixels])  # fmt: skip
        values[name] = engine.compute_values(batch, 4)[batch.mask]
    assert values["seen"].abs().max() > 0  # the trained head, not a fresh zero one
    assert not torch.allclose(values["seen"], values["blank"])  # it reads the picture
