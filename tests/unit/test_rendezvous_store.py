"""The rendezvous store of the built-in trainer's ranks (launcher/train/runtime.py): rank 0 serves it on the
address the ranks reach it at, not on every interface of its node (a new user's trial: torch's own TCPStore
listened on *:PORT, where any user of the node could connect)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train.runtime import rendezvous_store


def _env(rank: int, port: int, addr: str = "127.0.0.1") -> RankEnv:
    return RankEnv(
        rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        num_nodes=1,
        master_addr=addr,
        master_port=port,
        job_id="1",
        restart_count=0,
        hosts=("127.0.0.1",),
        source="slurm",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RANK_1 = """
import sys
from tests.unit.test_rendezvous_store import _env
from meshrun.launcher.train.runtime import rendezvous_store
store = rendezvous_store(_env(1, int(sys.argv[1])))
store.set("from-1", "hello")
assert store.get("from-0") == b"there"
"""


def test_rank_0_listens_on_the_master_address_alone_and_the_ranks_meet_there() -> None:
    port = _free_port()
    repo = str(Path(__file__).resolve().parents[2])
    # First: rank 0's store waits for the others to join, as at a job's start.
    other = subprocess.Popen(
        [sys.executable, "-c", RANK_1, str(port)], cwd=repo, env={**os.environ, "PYTHONPATH": repo}
    )
    store = rendezvous_store(_env(0, port))
    listening = [
        c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port
    ]
    assert [addr.ip for addr in listening] == ["127.0.0.1"], listening  # not 0.0.0.0 or ::
    store.set("from-0", "there")
    assert store.get("from-1") == b"hello"
    assert other.wait(timeout=60) == 0


def test_an_address_this_host_cannot_bind_leaves_the_listener_to_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from meshrun.launcher.train.runtime import _listener

    assert _listener("192.0.2.1", _free_port()) is None  # TEST-NET-1: never this host's
    assert "cannot listen on 192.0.2.1:" in capsys.readouterr().out
