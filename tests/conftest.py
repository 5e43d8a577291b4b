"""Shared fixtures: a real data plane (its own process, loopback), and cleanup checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Plane:
    controller: str
    storage: str
    proc: subprocess.Popen
    shm_dir: str


def start_plane(
    tmp: Path, *extra: str, env: dict[str, str] | None = None, shm_dir: str | None = None
) -> Plane:
    ready = tmp / f"ready-{time.monotonic_ns()}.json"
    shm = shm_dir or str(tmp / "shm")
    os.makedirs(shm, exist_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshrl.dataplane.serve",
            "--ready-file",
            str(ready),
            "--shm-dir",
            shm,
            *extra,
        ],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read().decode() if proc.stdout else ""
            proc.kill()
            raise RuntimeError(f"data plane did not start:\n{out}")
        time.sleep(0.02)
    info = json.loads(ready.read_text())
    return Plane(info["controller"], info.get("storage", ""), proc, shm)


def stop_plane(plane: Plane) -> str:
    if plane.proc.poll() is None:
        plane.proc.send_signal(signal.SIGTERM)
    try:
        out, _ = plane.proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        plane.proc.kill()
        out, _ = plane.proc.communicate()
    return out.decode() if out else ""


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    """Controller + storage as one real process on loopback, with a private shared-memory directory."""
    p = start_plane(tmp_path)
    yield p
    stop_plane(p)
    left = os.listdir(p.shm_dir)
    assert not left, f"segments left behind after shutdown: {left}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init ~1M-parameter Qwen2 with the character tokenizer, saved with save_pretrained."""
    from meshrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny vision-language model (Idefics3 over the character tokenizer) and its processor."""
    from meshrl.models.tiny import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "vlm")


@pytest.fixture(scope="session")
def processor(vlm: Path) -> Any:
    """The tiny vision-language model's processor."""
    from meshrl.models import vision

    return vision.load_processor(str(vlm))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init mixture of experts of the tiny model's size (Qwen3-MoE: 4 experts, 2 per token)."""
    from meshrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "moe", arch="qwen3_moe")


@pytest.fixture(scope="session")
def arith_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after the demo's supervised warm start on arithmetic (imperfect on purpose)."""
    from meshrl.commands.demo import warm_start

    out = tmp_path_factory.mktemp("models") / "arith-sft"
    warm_start(tiny_model, out)
    return out


@pytest.fixture(scope="session")
def grpo_100_steps(arith_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directory of recipes/grpo_arith.py trained 100 steps from the warm start: the learning test
    and the asynchronous comparison share it (one run instead of two)."""
    from tests.integration.grpo.test_grpo import run

    tmp = tmp_path_factory.mktemp("grpo100")
    r = run(tmp, f"*.model={arith_model}", f"run_dir={tmp / 'run'}", "total_steps=100")
    assert r.returncode == 0, r.stderr[-4000:]
    return tmp / "run"


def _sft(base: Path, out: Path, steps: int) -> Path:
    from meshrl.commands.demo import warm_start

    warm_start(base, out, steps)
    return out


@pytest.fixture(scope="session")
def teacher_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A strong arithmetic model (a longer supervised run: ~100% greedy accuracy), as recipes/opd_arith.py
    documents it."""
    return _sft(tiny_model, tmp_path_factory.mktemp("models") / "arith-teacher", 150)


@pytest.fixture(scope="session")
def weak_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weak student: half the demo's warm start (~10% greedy accuracy)."""
    return _sft(tiny_model, tmp_path_factory.mktemp("models") / "arith-weak", 28)


PORT_RANGE = (10000, 32000)  # below Linux's ephemeral range (32768-60999), where any connection's
# local end may take a port at any moment (seen in CI as EADDRINUSE on a trainer's rendezvous port)
PORT_STRIDE = 600  # a run's ports: base .. base + 2 + launchers_on_host * 512 + processes * 4
_handed_out = 0


@pytest.fixture(scope="session")
def tok() -> Any:
    """The tiny model's character tokenizer (meshrl/models/tiny.py)."""
    from meshrl.models.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def thinking() -> Any:
    """The same with a reasoning chat template that drops earlier turns' <think> blocks (Qwen3-like)."""
    from meshrl.models.tiny import build_tokenizer

    return build_tokenizer(reasoning=True)


def free_base_port() -> int:
    """A base port with room for a run's ports above it. Each pytest-xdist worker hands out bases from
    its own slice of the range, one stride after another, so runs of parallel tests never overlap (a
    random base did, about once a suite, as EADDRINUSE); ports still held by something are skipped."""
    import socket

    global _handed_out
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker.startswith("gw") else 0
    slots = (PORT_RANGE[1] - PORT_RANGE[0]) // PORT_STRIDE // max(workers, 1)
    offset = os.getpid() if not worker else 0  # plain pytest processes side by side: spread them
    for _ in range(slots):
        slot = index * slots + (offset + _handed_out) % slots
        _handed_out += 1
        base = PORT_RANGE[0] + slot * PORT_STRIDE
        try:
            for port in [*range(base, base + 40), *range(base + 514, base + 530)]:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` need CUDA devices (`gpus(n)` in the marker: that many); without them they are
    skipped, saying why."""
    marked = [(item, item.get_closest_marker("gpu")) for item in items]
    marked = [(item, m) for item, m in marked if m is not None]
    if not marked:
        return
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item, m in marked:
        need = int(m.kwargs.get("gpus", 1))
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), {have} here"))
