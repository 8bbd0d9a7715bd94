"""tests/hygiene.py: a session names only the processes a gone session of this checkout left (never a live
session's, never another checkout's), and stops only its own. Every process here is started by this test and
stopped by it (by pid) whatever happens: nobody else's process is signalled."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from meshrun.launcher.contract import procs
from tests import hygiene

GONE = "999999999:1.0"  # a session whose pytest no longer runs (no such pid)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs_started: list[subprocess.Popen[bytes]] = []
    try:
        yield procs_started
    finally:
        for proc in procs_started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def spawn(started: list[subprocess.Popen[bytes]], session: str, checkout: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, hygiene.SESSION_ENV: session, hygiene.CHECKOUT_ENV: checkout}
    env["PYTEST_CURRENT_TEST"] = "tests/x.py::test_leaky (call)"
    proc = subprocess.Popen(["sleep", "600"], env=env)
    started.append(proc)
    deadline = time.monotonic() + 10
    while procs.process_identity(proc.pid) is None or "sleep" not in " ".join(procs.command_line(proc.pid) or []):
        assert time.monotonic() < deadline
        time.sleep(0.02)  # until it has exec'd: its environment is the one given
    return proc


def test_only_a_gone_sessions_processes_of_this_checkout_are_strays(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    checkout = str(tmp_path / "checkout")
    live = f"{procs.own_identity().pid}:{procs.own_identity().started_at!r}"  # this very process: a live session
    stray = spawn(started, GONE, checkout)
    spawn(started, live, checkout)
    spawn(started, GONE, str(tmp_path / "another-checkout"))
    assert hygiene.session_alive(live) and not hygiene.session_alive(GONE) and not hygiene.session_alive("x")
    found = hygiene.strays(checkout)
    assert [m.identity.pid for m in found] == [stray.pid]
    message = hygiene.refusal(checkout)
    assert message is not None and f"pid {stray.pid} (started by tests/x.py::test_leaky in test session" in message
    assert f"kill {stray.pid}" in message and hygiene.ALLOW_ENV in message
    assert all(proc.poll() is None for proc in started)  # named, never signalled


def test_a_session_stops_only_what_it_left_itself(tmp_path: Path, started: list[subprocess.Popen[bytes]]) -> None:
    checkout = str(tmp_path / "checkout")
    mine = f"{procs.own_identity().pid}:{procs.own_identity().started_at!r}"
    leak = spawn(started, mine, checkout)
    other = spawn(started, "1:0.0", checkout)  # another session's (whatever its state): not ours to stop
    left = hygiene.leftovers(mine, checkout)
    assert [m.identity.pid for m in left] == [leak.pid]
    hygiene.stop(left, grace_s=5)
    assert leak.wait(timeout=10) != 0
    assert other.poll() is None
