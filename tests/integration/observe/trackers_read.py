"""Reading back what each tracker wrote, with the tracker's own formats (test helpers)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] through TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    out: dict[str, list[tuple[int, float]]] = {}
    for run in mux.Runs():
        acc = mux.GetAccumulator(run)
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def tensorboard_texts(logdir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    texts = []
    for path in logdir.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            texts += [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)]
    return texts


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of the offline W&B run in `run_dir`/wandb: its .wandb file is a record log (32 KiB
    blocks of checksummed, possibly fragmented records) of protobuf Records."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    rows, pos, pending = [], 7, b""
    block = 32 * 1024
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too small for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})  # fmt: skip
        elif kind == 0:
            break
    return rows


def mlflow_metrics(run_dir: Path, experiment: str) -> dict[str, list[tuple[int, float]]]:
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
