"""The probe files of a role (zserve.runtime.health_files, RoleSession): ``alive`` kept fresh by
the event loop, ``ready`` only while the role serves, both gone when it leaves; and the shell
probe that Kubernetes runs on them (examples/kubernetes/probe.sh)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import zmq

from zserve.config.cluster import parse_config, role_config
from zserve.runtime.health_files import ALIVE_FILE, READY_FILE, HealthFiles
from zserve.runtime.session import RoleSession

PROBE = Path(__file__).resolve().parents[2] / "examples" / "kubernetes" / "probe.sh"


def probe(folder: Path, check: str, **env: str) -> int:
    return subprocess.run(["sh", str(PROBE), check], env={
        "PATH": os.environ["PATH"], "ZSERVE_HEALTH_DIR": str(folder), **env},
        capture_output=True, check=False, timeout=10).returncode


async def test_alive_is_touched_by_the_loop_and_ready_is_explicit(tmp_path: Path) -> None:
    folder = tmp_path / "health"
    files = HealthFiles.from_env({"ZSERVE_HEALTH_DIR": str(folder)})
    (tmp_path / "health").mkdir()
    (folder / READY_FILE).write_text("a previous process\n")
    files.start()
    assert await _soon(folder / ALIVE_FILE)
    assert not (folder / READY_FILE).exists()  # a previous process's file is not this one's
    assert probe(folder, "alive") == 0 and probe(folder, "ready") == 1
    os.utime(folder / ALIVE_FILE, (1.0, 1.0))  # as if the loop stopped long ago
    assert probe(folder, "alive") == 1
    files.ready()
    assert probe(folder, "ready") == 0
    files.unready()
    assert probe(folder, "ready") == 1
    await files.close()
    assert not list(folder.iterdir())
    assert probe(folder, "bogus") == 2
    HealthFiles.from_env({}).start()  # without the variable: nothing, and no error


async def _soon(path: Path) -> bool:
    for _ in range(100):
        if path.exists():
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_session_is_ready_while_it_serves_and_unready_once_a_drain_is_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "health"
    monkeypatch.setenv("ZSERVE_HEALTH_DIR", str(folder))
    cluster = parse_config({"models": [{"name": "m",
                                        "emulated": {"alpha_ms": 1.0, "beta_ms": 2.0}}]})
    config = role_config(cluster, "backend", 0, ipc_dir=str(tmp_path))
    async with RoleSession.open(config, None, role="backend") as session:
        assert isinstance(session.ctx, zmq.Context)
        assert await _soon(folder / ALIVE_FILE)
        assert not (folder / READY_FILE).exists()  # bound and loading: not serving yet
        serving = asyncio.ensure_future(session.drained())
        assert await _soon(folder / READY_FILE)
        session.drain.request("test")
        drain = await serving
        assert drain.reason == "test" and not (folder / READY_FILE).exists()
    assert not (folder / ALIVE_FILE).exists()
