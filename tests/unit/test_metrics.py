"""Named metrics: reductions by the catalogue's rule, families, sinks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from meshrl.observe.metrics import CATALOGUE, JsonlSink, Metrics, Reduce, lookup, merged


def test_each_name_reduces_as_the_catalogue_says():
    m = Metrics()
    m.add("reward_mean", torch.tensor([1.0, 0.0, 0.5]))
    m.add("reward_mean", 0.5)
    m.add("reward_std", torch.tensor([1.0, 3.0]))
    m.add("failed", torch.tensor([True, False, True]))
    m.add("failed", 2.0)
    m.add("ratio_max", torch.tensor([1.5, 0.2]))
    m.add("ratio_max", 1.7)
    m.add("advantage_absmax", torch.tensor([]))
    out = m.reduce()
    assert out["reward_mean"] == pytest.approx(0.5)
    assert out["reward_std"] == pytest.approx(1.0)
    assert out["failed"] == 4.0 and out["ratio_max"] == 1.7
    assert out["advantage_absmax"] == 0.0  # nothing to take the max of


def test_merging_mini_batches_averages_sums_counts_and_keeps_the_largest_max():
    rows = [
        {"loss": 1.0, "nan_skipped": 0.0, "ratio_max": 1.2, "time/optimizer_s": 0.25},
        {"loss": 3.0, "nan_skipped": 1.0, "ratio_max": 1.1, "time/optimizer_s": 0.5},
    ]
    assert merged(rows) == {"loss": 2.0, "nan_skipped": 1.0, "ratio_max": 1.2, "time/optimizer_s": 0.75}
    assert merged([]) == {}


def test_teacher_families_and_unknown_names():
    assert lookup("teacher_kl").reduce is Reduce.MEAN and lookup("math_tutor_agreement").reduce is Reduce.MEAN
    with pytest.raises(KeyError, match="not in meshrl/observe/metrics.py's CATALOGUE"):
        Metrics().add("rewardmean", 1.0)
    assert all(entry.doc for entry in CATALOGUE.values())


def test_a_std_of_one_value_is_zero_and_of_none_too():
    m = Metrics()
    m.add("advantage_std", torch.tensor([2.0]))
    assert m.reduce() == {"advantage_std": 0.0}
    assert not math.isnan(Metrics().reduce().get("advantage_std", 0.0))


def test_jsonl_sink_starts_afresh_keeps_a_resumed_runs_lines_or_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
    sink = JsonlSink(path, keep=2)
    sink.write({"step": 2, "loss": 0.5})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1, 2] and sink.lines == 3
    JsonlSink(path, keep=None).write({"step": 3})
    assert len(path.read_text().splitlines()) == 4
    JsonlSink(path)
    assert path.read_text() == ""
