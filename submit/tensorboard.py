"""`meshrun tb JOB [JOB...]`: TensorBoard for runs, on the login node, reached through the SSH connection.

One round trip starts it: the standalone helper (tbserve.py) travels as the
command's input, is written into ~/.cache/meshrun/tb/ on the login node and run
with the cluster's setup lines and python; it reuses a live server of the same
runs or starts one bound to 127.0.0.1, serving the event files the jobs wrote
(RUN_DIR/tensorboard/), each run named by its label (the job id). The local end is a port forward on this machine's 127.0.0.1. On
Ctrl-C the forward closes and, if this command started the server, so does it.
On the login node itself (local transport) there is nothing to forward: it
prints the URL and the `ssh -L` line a user on a laptop would need.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from submit.cluster import ClusterProfile
from submit.errors import ClusterError, InputError
from submit.schedulers import backend
from submit.transport import LocalTransport, Transport

HELPER = Path(__file__).with_name("tbserve.py")
_INSTALL = (
    'd="${XDG_CACHE_HOME:-$HOME/.cache}/meshrun/tb" && mkdir -p "$d" && chmod 0700 "$d" && '
    'cat > "$d/.tbserve.py.$$" && mv -f "$d/.tbserve.py.$$" "$d/tbserve.py" && '
    'py="$1" && shift && exec "$py" "$d/tbserve.py" start "$@"'
)
_STOP = 'grep -q tbserve "/proc/$1/cmdline" 2>/dev/null && kill "$1"'


@dataclass(frozen=True)
class Board:
    port: int
    """Its port on the login node (127.0.0.1)."""
    pid: int
    reused: bool
    """Already running before this command (then this command leaves it running)."""


PORT_FIX = "give a free port in 1024-65535, or 0 for any free one"


def check_local_port(port: int) -> None:
    """`--port`: in range and free on this machine's 127.0.0.1, checked before TensorBoard is started.

    (The forward binds it again later; a port taken in between fails there, in one line too.)
    """
    if not 0 <= port <= 65535:
        raise InputError("--port", port, f"ports are numbered 0-65535; {PORT_FIX}")
    if port == 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the forward binds it
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen(1)
        except OSError as exc:
            raise InputError(
                "--port", port, f"cannot listen on 127.0.0.1:{port} ({exc.strerror}); {PORT_FIX}"
            ) from None


def label(job_id: str) -> str:
    """A run's name in TensorBoard (and its folder name in the server's tree): the job id, made a safe name."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_id)
    return safe if safe.strip(".") else f"job{safe}"


def start_argv(profile: ClusterProfile, runs: Sequence[tuple[str, str]]) -> list[str]:
    """bash -c 'SETUP; install the helper; run it' sh PYTHON LABEL RUN_DIR...: setup lines are the profile's
    trusted, verbatim bash (as in the batch script); python, labels and run dirs arrive as positional values."""
    python = backend(profile.scheduler).interpreter(profile)
    script = "\n".join([*profile.setup, _INSTALL])
    return ["bash", "-c", script, "meshrun-tb", python, *(value for pair in runs for value in pair)]


def parse_start(stdout: str) -> Board:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            return Board(port=int(data["port"]), pid=int(data["pid"]), reused=bool(data["reused"]))
    raise ClusterError(f"tensorboard helper printed no port (got {stdout.strip()[-200:]!r})")


def start(transport: Transport, profile: ClusterProfile, runs: Sequence[tuple[str, str]]) -> Board:
    """Serve `runs` ((label, run dir) pairs) in one TensorBoard."""
    done = transport.run(start_argv(profile, runs), timeout=180, stdin=HELPER.read_bytes())
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        last = detail[-1] if detail else f"exit code {done.returncode}"
        raise ClusterError(
            f"could not start TensorBoard on {profile.name}: {last} (is tensorboard installed in "
            f"the environment the profile's setup lines activate?)"
        )
    return parse_start(done.stdout)


def stop(transport: Transport, board: Board) -> None:
    transport.run(["sh", "-c", _STOP, "sh", str(board.pid)], timeout=30)


def ssh_hint(port: int, local_port: Optional[int] = None) -> str:
    """What a user on a laptop runs to reach a TensorBoard on this login node."""
    host = socket.getfqdn() or socket.gethostname()
    return f"ssh -N -L {local_port or port}:127.0.0.1:{port} {getpass.getuser()}@{host}"


def is_local(transport: Transport) -> bool:
    return isinstance(transport, LocalTransport)
