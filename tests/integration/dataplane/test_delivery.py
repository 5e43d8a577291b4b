"""Delivery guarantees of the data plane, with real processes on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from meshrl.dataplane import Client, DataPlaneError, LeaseExpired, PartitionFull, Ragged

WORKER = str(Path(__file__).with_name("dp_worker.py"))


def worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_exactly_once_across_concurrent_consumers_and_independent_names(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 4096)
        same_name = [worker("consume", plane.controller, "rows", "trainer", "16", "2.0") for _ in range(3)]
        other_name = worker("consume", plane.controller, "rows", "critic", "50", "2.0")
        for p in [*same_name, other_name]:  # all waiting before the first row: each can get a share
            assert json.loads(p.stdout.readline()) == {"ready": True}  # type: ignore[union-attr]
        producers = [worker("produce", plane.controller, "rows", "600", "37") for _ in range(2)]
        written = {i: x for p in producers for i, x in result(p)["pairs"]}
        assert len(written) == 1200
        per_consumer = [result(p)["pairs"] for p in same_name]
        seen = Counter(i for pairs in per_consumer for i, _ in pairs)
        assert set(seen) == set(written), "a row was lost"
        assert max(seen.values()) == 1, "a row was delivered twice under one consumer name"
        assert all(written[i] == x for pairs in per_consumer for i, x in pairs), "payload mixed up"
        assert sum(1 for pairs in per_consumer if pairs) >= 2, "consumers did not share the work"
        critic = dict(result(other_name)["pairs"])
        assert critic == written, "a second consumer name must see every row independently"
        st = c.status().partitions[0]
        assert {s.name: s.acked for s in st.consumers} == {"trainer": 1200, "critic": 1200}


def test_lease_returns_rows_of_a_consumer_that_hangs(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 64)
        ids = c.put("rows", {"x": torch.arange(10)})
        hung = worker("claim_and_hang", plane.controller, "rows", "trainer", "6", "1.5")
        line = hung.stdout.readline()  # type: ignore[union-attr]
        claimed = json.loads(line)["claimed"]
        assert claimed == ids[:6].tolist()
        os.kill(hung.pid, signal.SIGSTOP)  # alive, connection open, doing nothing
        try:
            first = c.claim("rows", "trainer", ["x"], 10)
            assert first.ids.tolist() == ids[6:].tolist(), "leased rows must not be handed out twice"
            c.ack(first)
            t0 = time.monotonic()
            back = c.claim("rows", "trainer", ["x"], 10, timeout=10)
            assert back.ids.tolist() == claimed, "rows of the hung consumer must come back after its lease"
            assert 0.5 < time.monotonic() - t0 < 5
            assert torch.equal(back["x"], torch.arange(6))  # type: ignore[arg-type]
        finally:
            os.kill(hung.pid, signal.SIGKILL)
            hung.wait()


def test_rows_of_a_killed_consumer_come_back_at_once(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 64)
        ids = c.put("rows", {"x": torch.arange(10)})
        hung = worker("claim_and_hang", plane.controller, "rows", "trainer", "6", "600")
        claimed = json.loads(hung.stdout.readline())["claimed"]  # type: ignore[union-attr]
        first = c.claim("rows", "trainer", ["x"], 10)
        assert first.ids.tolist() == ids[6:].tolist()
        c.ack(first)
        t0 = time.monotonic()
        os.kill(hung.pid, signal.SIGKILL)  # the kernel closes its connection: no need to wait 600 s
        hung.wait()
        back = c.claim("rows", "trainer", ["x"], 10, timeout=10)
        assert back.ids.tolist() == claimed and time.monotonic() - t0 < 2
        c.ack(back)
        assert c.status().partitions[0].consumers[0].acked == 10


def test_ack_after_lease_expiry_is_refused(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 8)
        c.put("rows", {"x": torch.arange(2)})
        slow = c.claim("rows", "t", ["x"], 2, lease=0.2)
        time.sleep(0.5)
        again = c.claim("rows", "t", ["x"], 2)
        assert again.ids.tolist() == slow.ids.tolist()
        with pytest.raises(LeaseExpired, match="lease expired"):
            c.ack(slow)
        assert c.ack(again) == 2


def test_back_pressure_waits_then_raises(plane):
    with Client(plane.controller) as c:
        c.create_partition("small", 4, delete_when_acked_by=["t"])
        c.put("small", {"x": torch.arange(4)})
        t0 = time.monotonic()
        with pytest.raises(PartitionFull, match="full .*stayed full"):
            c.put("small", {"x": torch.arange(2)}, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 3
        with pytest.raises(PartitionFull, match="can never fit"):
            c.put("small", {"x": torch.arange(5)}, timeout=0.5)
        # a consumer frees room while a producer waits: the put goes through
        consumer = worker("consume", plane.controller, "small", "t", "2", "2.0")
        ids = c.put("small", {"x": torch.arange(100, 104)}, timeout=20)
        assert len(ids) == 4
        got = [i for i, _ in result(consumer)["pairs"]]
        assert len(got) == 8 and len(set(got)) == 8
        assert c.status().partitions[0].rows == 0


def test_partial_columns_become_visible_only_when_complete(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 16)
        ids = c.put("rows", {"tokens": [torch.arange(3), torch.arange(5)]})
        assert not c.claim("rows", "trainer", ["tokens", "reward"], 2)
        c.put("rows", {"reward": torch.tensor([0.5])}, ids=ids[:1])
        b = c.claim("rows", "trainer", ["tokens", "reward"], 2)
        assert b.ids.tolist() == ids[:1].tolist()
        c.put("rows", {"reward": torch.tensor([1.5])}, ids=ids[1:])
        b2 = c.claim("rows", "trainer", ["tokens", "reward"], 2, timeout=5)
        assert b2.ids.tolist() == ids[1:].tolist()
        assert b2["tokens"].tolist()[0].tolist() == [0, 1, 2, 3, 4]  # type: ignore[union-attr]
        with pytest.raises(Exception, match="already written"):
            c.put("rows", {"reward": torch.tensor([9.0])}, ids=ids[1:])


def test_parked_claim_is_woken_by_a_put(plane):
    with Client(plane.controller) as c, Client(plane.controller) as waiter:
        c.create_partition("rows", 16)
        producer = worker("produce", plane.controller, "rows", "3", "3")
        t0 = time.monotonic()
        b = waiter.claim("rows", "t", ["x"], 3, min_n=3, timeout=30)
        assert len(b) == 3 and time.monotonic() - t0 < 20
        result(producer)


def test_whole_group_claims(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 64)
        # groups 0..2 of 4 rows, interleaved and written in pieces; group 3 stays incomplete
        order = [0, 1, 0, 2, 1, 3, 2, 0, 1, 2, 0, 1, 2, 3]
        c.put("rows", {"x": torch.tensor(order)}, meta=[{"group": g} for g in order])
        b = c.claim("rows", "trainer", ["x"], 8, group_size=4)
        groups = b["x"].tolist()  # type: ignore[union-attr]
        assert len(groups) == 8 and groups[:4] == [0] * 4 and groups[4:] == [1] * 4
        assert b.meta_of("group") == groups
        rest = c.claim("rows", "trainer", ["x"], 8, group_size=4)
        assert rest["x"].tolist() == [2] * 4  # type: ignore[union-attr]
        assert not c.claim("rows", "trainer", ["x"], 8, group_size=4)
        c.put("rows", {"x": torch.tensor([3, 3])}, meta=[{"group": 3}] * 2)
        last = c.claim("rows", "trainer", ["x"], 4, group_size=4, timeout=5)
        assert last["x"].tolist() == [3] * 4  # type: ignore[union-attr]
        with pytest.raises(Exception, match="can never hold a group"):
            c.claim("rows", "trainer", ["x"], 3, group_size=4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16])
def test_ragged_round_trip_is_bit_exact(plane, dtype):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, 3, generator=g).to(dtype) * 1e3 for n in (0, 1, 7, 300, 2)]
    if dtype is torch.int64:
        rows = [torch.randint(-(2**62), 2**62, (len(r), 3), generator=g) for r in rows]
    with Client(plane.controller) as c:
        c.create_partition("rows", 16)
        c.put("rows", {"v": rows, "d": torch.arange(5, dtype=dtype)})
        b = c.claim("rows", "t", ["v", "d"], 5)
        got = b["v"]
        assert isinstance(got, Ragged) and got.values.dtype == dtype
        for want, have in zip(rows, got, strict=True):
            assert have.shape == want.shape
            assert torch.equal(have.view(torch.uint8), want.contiguous().view(torch.uint8))
        padded, mask = got.padded()
        assert padded.shape == (5, 300, 3) and int(mask.sum()) == 310


def test_reads_from_another_host_come_from_its_storage_server(plane):
    """A client that is not on the writer's host gets the bytes as ZMQ frames from storage."""
    with Client(plane.controller) as c:
        c.create_partition("rows", 16)
        ids = c.put("rows", {"v": [torch.arange(5), torch.arange(9)], "r": torch.tensor([1.0, 2.0])})
    env = {**os.environ, "MESHRL_HOST_ID": "elsewhere"}
    code = (
        "import sys, torch; from meshrl.dataplane import Client\n"
        f"c = Client({plane.controller!r}); b = c.claim('rows', 'remote', ['v', 'r'], 2)\n"
        "assert c.core.host == 'elsewhere' and c._storage_socks, 'expected a remote read'\n"
        "print(b.ids.tolist(), [t.tolist() for t in b['v']], b['r'].tolist()); c.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{ids.tolist()} [{list(range(5))}, {list(range(9))}] [1.0, 2.0]"


def test_status_reports_counts_backlog_and_age(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 32)
        c.put("rows", {"a": torch.arange(5)})
        c.put("rows", {"a": torch.arange(3), "b": torch.arange(3)})
        b = c.claim("rows", "ab", ["a", "b"], 2)
        time.sleep(0.05)
        st = c.status().partitions[0]
        assert (st.rows, st.capacity, st.columns) == (8, 32, {"a": 8, "b": 3})
        [ab] = st.consumers
        assert (ab.ready, ab.claimed, ab.acked) == (1, 2, 0)
        assert st.oldest_age_s >= 0.05
        c.release(b)
        assert c.status().partitions[0].consumers[0].ready == 3


def test_stream_and_async_acks(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 64, delete_when_acked_by=["t"])
        for k in range(5):
            c.put("rows", {"x": torch.arange(8) + 8 * k}, wait=False)
        c.flush()
        seen = []
        stream = c.stream("rows", "t", ["x"], 8, min_n=8, poll=0.2)
        for _, b in zip(range(5), stream, strict=False):
            seen.extend(b["x"].tolist())  # type: ignore[union-attr]
            c.ack(b, wait=False)
        stream.close()
        c.flush()
        assert seen == list(range(40))
        assert c.status().partitions[0].rows == 0


def test_a_put_repeated_under_its_key_is_applied_once(plane, tmp_path):
    """A restarted producer cannot know whether its predecessor's last put went through: it repeats the
    put under the same key and gets the same ids, and the table and the ledger hold the rows once."""
    with Client(plane.controller, name="feeder") as c:
        c.create_partition("rows", 64, delete_when_acked_by=["reader"])
        first = c.put("rows", {"x": torch.arange(4)}, meta=[{"group": 1}] * 4, key="feeder/feed/1")
        # consumed and deleted meanwhile: the key still answers, no rows come back to life
        batch = c.claim("rows", "reader", ["x"], 8)
        assert batch.ids.tolist() == first.tolist()
        c.ack(batch)
    with Client(plane.controller, name="feeder") as again:  # the restarted process: a new connection
        repeat = again.put("rows", {"x": torch.arange(4) + 100}, meta=[{"group": 1}] * 4, key="feeder/feed/1")
        assert repeat.tolist() == first.tolist()
        assert again.claim("rows", "reader", ["x"], 8, timeout=0.2).ids.tolist() == []
        fresh = again.put("rows", {"x": torch.arange(2)}, key="feeder/feed/2")
        assert fresh.tolist() == [first[-1] + 1, first[-1] + 2]
        # the repeated put's segment went back to the producer: many repeats do not pile segments up
        for _ in range(20):
            again.put("rows", {"x": torch.arange(4)}, key="feeder/feed/1")
        assert len(again.core.pool._busy) <= 2, again.core.pool._busy
        assert again.status().partitions[0].rows == 2


def test_an_empty_or_overlong_put_key_is_refused_naming_it(plane):
    with Client(plane.controller) as c:
        c.create_partition("rows", 8)
        for key in ("", "k" * 201):
            with pytest.raises(DataPlaneError, match="put key must be 1 to 200 characters"):
                c.put("rows", {"x": torch.arange(2)}, key=key)
        assert c.put("rows", {"x": torch.arange(2)}, key="k" * 200).tolist() == [0, 1]  # nothing was written
