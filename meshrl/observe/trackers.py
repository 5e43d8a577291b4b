"""Experiment trackers: TensorBoard, Weights & Biases, MLflow, each an optional extra.

A tracker takes rows the lead launcher read from the run's files (`follow.py`): scalars by name on the
run's step axis (the weight version: steps trained so far) and, for sample completions, a table per
step. Each is opened with the resolved recipe as its config and keeps the ids of what it opened in
<run_dir>/trackers.json, so a restarted or resumed run goes on logging into the same tracker run.

`Guarded` wraps each one: the first exception a tracker raises (a package not installed, bad
credentials, a full disk) is logged once as a warning and that tracker is dropped; the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from meshrl.planning.recipe import LogConfig

log = logging.getLogger("meshrl.trackers")

SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "advantage", "version", "staleness")
"""The columns of a step's table of sample completions (samples.jsonl rows carry more: the reward of
each function, when there are several)."""


class Tracker(Protocol):
    def scalars(self, step: int, values: Mapping[str, float]) -> None: ...

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def open_trackers(cfg: LogConfig, run_dir: Path, config: dict[str, Any]) -> list[Tracker]:
    """The trackers `cfg` asks for, each guarded; `config` is the resolved recipe (config.json)."""
    ids = Ids(run_dir / "trackers.json")
    wanted: list[tuple[str, Any]] = []
    if cfg.tensorboard:
        wanted.append(("tensorboard", lambda: TensorBoard(run_dir / "tensorboard")))
    if cfg.wandb.project:
        wanted.append(("wandb", lambda: Wandb(cfg, run_dir, config, ids)))
    if cfg.mlflow.experiment:
        wanted.append(("mlflow", lambda: Mlflow(cfg, run_dir, config, ids)))
    out: list[Tracker] = []
    for name, make in wanted:
        try:
            out.append(Guarded(name, make()))
        except Exception as e:
            log.warning("tracker %s could not start (%s: %s); the run goes on without it", name,
                        type(e).__name__, e)  # fmt: skip
    return out


class Guarded:
    """A tracker whose first failure drops it with one warning."""

    def __init__(self, name: str, tracker: Any) -> None:
        self.name, self.tracker = name, tracker

    def _call(self, method: str, *args: Any) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as e:
            log.warning("tracker %s failed (%s: %s); the run goes on without it", self.name,
                        type(e).__name__, e)  # fmt: skip
            tracker, self.tracker = self.tracker, None
            if method != "close":
                with contextlib.suppress(Exception):
                    tracker.close()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._call("scalars", step, values)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._call("samples", step, rows)

    def close(self) -> None:
        self._call("close")


class Ids:
    """The ids of the tracker runs of this run directory (trackers.json)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, name: str) -> str | None:
        try:
            return json.loads(self.path.read_text()).get(name)
        except (OSError, ValueError):
            return None

    def set(self, name: str, value: str) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        data[name] = value
        self.path.write_text(json.dumps(data) + "\n")


def _table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[row.get(c) for c in SAMPLE_COLUMNS] for row in rows]


class TensorBoard:
    """Event files in `logdir`, written with tensorboard's own writer (no TensorFlow, no torch)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.Summary, self.Metadata = Summary, SummaryMetadata
        self.writer = EventFileWriter(str(logdir))

    def _event(self, step: int, values: list[Any]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=self.Summary(value=values)))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._event(step, [self.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self.writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A markdown table (TensorBoard's text plugin)."""
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto

        lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
        for cells in _table(rows):
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        text = "\n".join(lines).encode()
        meta = self.Metadata(plugin_data=self.Metadata.PluginData(plugin_name="text"))
        tensor = TensorProto(dtype=7, string_val=[text], tensor_shape=TensorShapeProto(dim=[]))  # DT_STRING
        self._event(step, [self.Summary.Value(tag="samples", metadata=meta, tensor=tensor)])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


class Wandb:
    """A W&B run in <run_dir>/wandb; offline without an API key (see LogConfig.wandb.mode)."""

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict[str, Any], ids: Ids) -> None:
        import wandb

        mode = cfg.wandb.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") or _netrc_has("api.wandb.ai") else "offline"
        run_id = ids.get("wandb") or secrets.token_hex(4)
        ids.set("wandb", run_id)
        self.wandb = wandb
        self.run = wandb.init(
            project=cfg.wandb.project, entity=cfg.wandb.entity or None, dir=str(run_dir), id=run_id,
            resume="allow", mode=mode, config=config, name=run_dir.name,
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        # one step axis for every service's rows, which may arrive out of order (an evaluation of
        # version 5 after the trainer's line of version 6)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({**values, "step": step})

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=_table(rows))
        self.run.log({"samples": table, "step": step})

    def close(self) -> None:
        self.run.finish()


def _mlflow_key(name: str) -> str:
    """MLflow allows letters, digits and _-. :/ in a metric's name: eval/pass@4 becomes eval/pass_4."""
    return re.sub(r"[^\w\-. :/]", "_", name)


def _netrc_has(host: str) -> bool:
    import netrc

    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Mlflow:
    """An MLflow run; by default in a file store in the run directory (<run_dir>/mlruns)."""

    def __init__(self, cfg: LogConfig, run_dir: Path, config: dict[str, Any], ids: Ids) -> None:
        from mlflow.tracking import MlflowClient

        uri = cfg.mlflow.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # MLflow 3 asks a file store to opt in; it is what the user chose
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        run_id = ids.get("mlflow")
        if run_id is None:
            exp = self.client.get_experiment_by_name(cfg.mlflow.experiment)
            exp_id = (
                exp.experiment_id if exp is not None else self.client.create_experiment(cfg.mlflow.experiment)
            )
            run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
            ids.set("mlflow", run_id)
            self.client.log_dict(run_id, config, "recipe.json")
        self.run_id = run_id

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key=_mlflow_key(k), value=float(v), timestamp=now, step=step) for k, v in values.items()
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, {"columns": list(SAMPLE_COLUMNS), "data": _table(rows)},
                             f"samples/step_{step:06d}.json")  # fmt: skip

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
