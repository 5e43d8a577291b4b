"""Checkpoint directories: complete or ignored, committed atomically, pruned; safe points for pausing."""

from __future__ import annotations

import asyncio
import json

from meshrl.state import checkpoint as ckpt


def make(run_dir, step: int, keep: int = 3):
    tmp = ckpt.tmp_dir(run_dir, step)
    (tmp / "trainer").mkdir(parents=True)
    (tmp / "trainer" / "shard").write_bytes(b"x" * 10)
    ckpt.save_json(tmp / "trainer.json", {"step": step})
    return ckpt.commit(tmp, step, keep)


def test_latest_skips_incomplete_and_damaged_checkpoints(tmp_path):
    assert ckpt.latest(tmp_path) is None
    make(tmp_path, 2)
    newest = make(tmp_path, 4)
    assert ckpt.latest(tmp_path) == newest
    (newest / "trainer" / "shard").unlink()  # a file the marker lists is gone
    assert ckpt.latest(tmp_path).name == "step-00000002"
    (newest / "trainer" / "shard").write_bytes(b"x")
    (newest / ckpt.COMPLETE).write_text("{not json")  # a torn marker
    assert ckpt.latest(tmp_path).name == "step-00000002"


def test_a_checkpoint_that_fails_midway_leaves_the_previous_one(tmp_path):
    make(tmp_path, 2)
    tmp = ckpt.tmp_dir(tmp_path, 4)
    tmp.mkdir(parents=True)
    (tmp / "trainer.json").write_text('{"step": 4')  # e.g. the disk filled up here: never committed
    assert ckpt.latest(tmp_path).name == "step-00000002"


def test_commit_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        make(tmp_path, step, keep=2)
    assert sorted(p.name for p in ckpt.root(tmp_path).glob("step-*")) == ["step-00000003", "step-00000004"]
    marker = json.loads((ckpt.latest(tmp_path) / ckpt.COMPLETE).read_text())
    assert marker["step"] == 4 and "trainer/shard" in marker["files"]


def test_truncate_jsonl_keeps_the_lines_written_before_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(5)))
    ckpt.truncate_jsonl(path, 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2]


def test_pause_waits_for_work_in_progress_and_holds_new_work():
    async def main() -> list[str]:
        pause, events = ckpt.Pause(), []

        async def worker(name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            async with pause.work():
                events.append(f"{name} start")
                await asyncio.sleep(0.05)
                events.append(f"{name} end")

        first = asyncio.create_task(worker("a", 0))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(worker("b", 0.02))
        await pause.hold()  # returns once "a" is done; "b" must not start meanwhile
        events.append("saved")
        await asyncio.sleep(0.05)
        pause.release()
        await asyncio.gather(first, second)
        return events

    assert asyncio.run(main()) == ["a start", "a end", "saved", "b start", "b end"]
