"""The runtime kit every role shares (once zserve/procutil.py): the peer map, the drain request,
the collection watch; and the generator's ceiling check (``zserve bench --max-rate-check``)."""

from __future__ import annotations

import asyncio
import gc
import json
import signal
from pathlib import Path

import zmq.asyncio

from zserve.loadgen import cli
from zserve.runtime import gc_watch
from zserve.runtime.control_link import ControlLink, DrainRequest
from zserve.runtime.peer_map import endpoints_of, peer_key, rank_address

PEERS = {
    "shard-1/shard": "ipc:///run/shard-1",
    "shard-0/shard": "ipc:///run/shard-0",
    "shard-0/rank": "ipc:///run/embedded-rank",
    "frontend-0/data": "ipc:///run/frontend-0.data",
}


def test_peer_map_lists_endpoints_by_name_and_finds_the_rank() -> None:
    assert peer_key("frontend-0", "data") == "frontend-0/data"
    assert list(endpoints_of(PEERS, "shard")) == ["shard-0", "shard-1"]
    assert rank_address(PEERS) == "ipc:///run/embedded-rank"  # shards = 0: in shard-0
    assert rank_address({**PEERS, "rank/rank": "ipc:///run/rank"}) == "ipc:///run/rank"
    assert rank_address({"frontend-0/data": "x"}) is None


async def test_a_second_drain_request_cuts_the_grace_period_short() -> None:
    drain = DrainRequest()
    assert not drain.requested
    drain.request("SIGTERM", drain_s=30.0)
    assert drain.requested and drain.reason == "SIGTERM" and not drain.immediate
    idle = asyncio.Event()
    grace = asyncio.ensure_future(drain.grace(idle))
    done, _ = await asyncio.wait({grace}, timeout=0.05)
    assert not done  # waiting for in-flight work, up to 30 s
    drain.request("SIGTERM again")
    assert await asyncio.wait_for(grace, timeout=5.0) is False
    assert drain.immediate and drain.drain_s == 0.0
    idle.set()
    assert await drain.grace(idle) is True


def test_gc_watch_counts_collections_and_resets() -> None:
    was_enabled = gc.isenabled()
    gc.disable()  # only the collections this test runs
    watch = gc_watch.install()
    try:
        gc.collect()
        first = gc_watch.gc_stats(reset=True)
        assert first["collections"] == [0, 0, 1]
        # One collection: its pause is the total and the longest, and it was measured (a full
        # collection of this process takes milliseconds, far above the 1 us the stats round to).
        assert first["pause_ms_total"][2] == first["pause_ms_max"][2] > 0.0
        assert gc_watch.gc_stats()["collections"] == [0, 0, 0]
        gc.collect(0)
        assert gc_watch.gc_stats()["collections"] == [1, 0, 0]
    finally:
        if was_enabled:
            gc.enable()
        watch.close()


def test_max_rate_check_finds_the_generators_ceiling(tmp_path: Path) -> None:
    out = tmp_path / "max-rate.json"
    code = cli.main(["--max-rate-check", "--workers", "1", "--measure", "0.5",
                     "--max-lateness-ms", "1000", "--precision", "0.5", "--json", str(out),
                     "--quiet"])
    assert code == cli.EXIT_OK
    report = json.loads(out.read_text())
    assert report["workers"] == 1 and report["max_rate_rps"] > 0
    assert report["probes"] and all("rate" in p and "pass" in p for p in report["probes"])


async def test_an_attached_link_gives_sigint_back_when_it_closes(tmp_path: Path) -> None:
    """Under a supervisor a role ignores Ctrl-C (the supervisor coordinates); a link opened in a
    longer-lived process (a test run) restores SIGINT at close, or every process started after
    it would inherit the ignored signal (a nested pytest session then could not be
    interrupted)."""
    before = signal.getsignal(signal.SIGINT)
    assert before is not signal.SIG_IGN
    ctx = zmq.asyncio.Context()
    try:
        link = await ControlLink.open(ctx, f"ipc://{tmp_path}/control", role="backend",
                                      name="backend-0")
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        await link.close()
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        ctx.term()
