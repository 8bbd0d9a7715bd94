"""`meshrun tb` listens on 127.0.0.1 only, read from the kernel's socket table (not by connecting, which
a 0.0.0.0 listener would answer too): the TensorBoard server meshrun starts on the login node, and the
local end of the SSH tunnel to it. Each process's LISTEN sockets are found in /proc/net/tcp and
/proc/net/tcp6 through the socket inodes of its /proc/PID/fd; each must be 127.0.0.1, never 0.0.0.0 or
an IPv6 address (`::` would take IPv4 too). Both runs happen on this machine: the laptop is the test,
the login node is the testbed's sshd, so both processes' /proc entries are readable here. Loopback is
shared by every user of each machine, so the server also answers only requests carrying its token: a second
real Unix user, on the same ports, gets 403."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.views import tbserve
from tests.helpers import sshbed, tbhelp
from tests.helpers.cli import REPO, env_for
from tests.helpers.tbhelp import Cleanup

LISTEN = "0A"  # TCP_LISTEN in the `st` column
JOB = "900077"


def _address(hex_addr: str) -> tuple[str, int]:
    """`0100007F:1F90` -> ('127.0.0.1', 8080): each 32-bit word of the address is in host byte order."""
    addr, port = hex_addr.split(":")
    raw = b"".join(
        bytes.fromhex(addr[i : i + 8])[:: -1 if sys.byteorder == "little" else 1] for i in range(0, len(addr), 8)
    )
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def _listening() -> dict[int, tuple[str, int]]:
    """socket inode -> (address, port) of every LISTEN socket on this machine (IPv4 and IPv6)."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == LISTEN:
                found[int(fields[9])] = _address(fields[1])
    return found


def _inodes(pid: int) -> set[int]:
    """The socket inodes a process holds open (its fds are shared by all its threads)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed while we looked
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listens(pid: int) -> list[tuple[str, int]]:
    """Where a process listens, from the socket table."""
    table, mine = _listening(), _inodes(pid)
    return sorted(table[inode] for inode in mine if inode in table)


def _server(run_dir: Path) -> tuple[Optional[int], Optional[int]]:
    """(pid, start time) of the `tbserve.py serve STATE` process serving this run (its state dir is named
    from the run)."""
    found = tbhelp.servers([tbserve.state_dir([(JOB, run_dir)]).name])
    return next(iter(found.items()), (None, None))


def _record(home: Path, run_dir: Path, over_ssh: bool) -> None:
    """A finished job whose run wrote metrics.jsonl only (the server converts it: no job needed)."""
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - s}) + "\n" for s in (1, 2)))
    profile = str(sshbed.profile(home)) if over_ssh else None
    cluster = "sshbed" if over_ssh else "testbed"
    registry = Registry(home / "state" / "meshrun" / "registry.sqlite")
    registry.add(JobRecord(JOB, cluster, "j", str(run_dir), "slurm", 0.0, None, "h", "COMPLETED", profile))
    registry.close()


@pytest.mark.parametrize("over_ssh", [True, False], ids=["laptop-over-ssh", "on-the-login-node"])
def test_tensorboard_and_tunnel_listen_on_loopback_only(
    testbed: dict[str, object], tmp_path: Path, over_ssh: bool, tb_cleanup: Cleanup
) -> None:
    """... and another user of either machine, on those very ports, gets 403; SIGHUP (the terminal closed,
    its output gone) stops the server."""
    run_dir = tmp_path / "run"
    _record(tmp_path, run_dir, over_ssh)
    tb_cleanup.runs([(JOB, run_dir)])
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshrun.submit.cli.main", "tb", JOB],
        cwd=REPO,
        text=True,
        env=env_for(tmp_path, laptop=over_ssh),  # the laptop has no Slurm: only the SSH road
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:")
        assert line, proc.stderr.read() if proc.poll() is not None else "no URL"  # type: ignore[union-attr]
        url = line.split()[-1]
        base, token = tbhelp.split_url(url)
        local_port = int(base.rstrip("/").rsplit(":", 1)[1])
        server, started = _server(run_dir)
        assert server is not None and server != proc.pid, "no tbserve process serving the run"
        # The server on the login node: one LISTEN socket, on the loopback address only.
        (where,) = listens(server)
        assert where[0] == "127.0.0.1", f"TensorBoard listens on {where[0]}:{where[1]}, not on 127.0.0.1 only"
        if over_ssh:
            # The tunnel's local end: meshrun itself listens, on 127.0.0.1 only, on the port it printed.
            tunnel = listens(proc.pid)
            assert tunnel == [("127.0.0.1", local_port)], f"the tunnel's local end listens on {tunnel}"
        else:
            # On the login node there is no tunnel: the URL is the server's own port, meshrun listens nowhere.
            assert where[1] == local_port and listens(proc.pid) == []
        browser = tbhelp.Browser(url)  # the URL really reaches that server (through the tunnel)
        tbhelp.until("the run", lambda: JOB in (browser.get("data/runs") or []), timeout=30)
        # Loopback is shared: another user, on the laptop's port and on the login node's, reads nothing.
        for port in {local_port, where[1]}:
            for path in ("data/runs", f"data/plugin/scalars/scalars?run={JOB}&tag=loss", f"?token={token[::-1]}"):
                code, body = tbhelp.http_code_as_other(f"http://127.0.0.1:{port}/{path}")
                assert code == 403 and JOB not in body, (port, path, code, body[:200])
        # The terminal closes: nobody reads meshrun's output any more, and SIGHUP arrives.
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0
        assert tbhelp.gone(server, started), "the TensorBoard server outlived a SIGHUP to meshrun tb"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
