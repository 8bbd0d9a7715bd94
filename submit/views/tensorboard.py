"""`meshrun tb JOB [JOB...]`: TensorBoard for runs, on the login node, reached through the SSH connection.

One round trip starts it: the standalone helper (tbserve.py) travels as the command's input, is
written into ~/.cache/meshrun/tb/ on the login node and run with the cluster's setup lines and
python; it reuses a live server of the same runs or starts one bound to 127.0.0.1, serving the event
files the jobs wrote (RUN_DIR/tensorboard/), each run named by its label (the job id). The local end
is a port forward on this machine's 127.0.0.1. Loopback is shared by every user of either machine, so
the server answers only requests carrying its secret token (see tbserve.py): the URL printed here
carries it once, and the browser keeps it as a cookie. On Ctrl-C, SIGTERM or SIGHUP the forward closes
and, if this command started the server, so does it; `meshrun tb --stop` stops one left running. On
the login node itself (local transport) there is nothing to forward: it prints the URL and the `ssh
-L` line a user on a laptop would need.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from meshrun.submit import api
from meshrun.submit.config.cluster import ClusterProfile
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.transport.base import LocalTransport, Transport

HELPER = Path(__file__).with_name("tbserve.py")
_INSTALL = (
    'umask 077 && d="${XDG_CACHE_HOME:-$HOME/.cache}/meshrun/tb" && mkdir -p "$d" && chmod 0700 "$d" && '
    'cat > "$d/.tbserve.py.$$" && mv -f "$d/.tbserve.py.$$" "$d/tbserve.py" && '
    'py="$1" && shift && exec "$py" "$d/tbserve.py" "$@"'
)


@dataclass(frozen=True)
class Board:
    port: int
    """Its port on the login node (127.0.0.1)."""
    pid: int
    reused: bool
    """Already running before this command (then this command leaves it running)."""
    token: str
    """The server's secret: every request must carry it (the URL once, then the cookie it sets)."""

    def url(self, local_port: int) -> str:
        """What the user opens: the server through this machine's port, with the token."""
        return f"http://127.0.0.1:{local_port}/?token={self.token}"


@dataclass(frozen=True)
class Stopped:
    """A server `meshrun tb --stop` ended (checked on the login node to be that user's tbserve first)."""

    pid: int
    runs: tuple[str, ...]


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


def helper_argv(profile: ClusterProfile, *args: str) -> list[str]:
    """bash -c 'SETUP; install the helper; run it' sh PYTHON ARGS...: setup lines are the profile's trusted,
    verbatim bash (as in the batch script); python and the helper's arguments arrive as positional values."""
    python = api.interpreter(profile)
    script = "\n".join([*profile.setup, _INSTALL])
    return ["bash", "-c", script, "meshrun-tb", python, *args]


def start_argv(profile: ClusterProfile, runs: Sequence[tuple[str, str]]) -> list[str]:
    """The helper's `start LABEL RUN_DIR...`: labels and run dirs as positional values, never shell text."""
    return helper_argv(profile, "start", *(value for pair in runs for value in pair))


def _last_json(stdout: str) -> dict[str, Any]:
    """The helper's answer: its last JSON line (a chatty setup line may print before it)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            data = json.loads(line)
            if isinstance(data, dict):
                return data
    raise ClusterError(f"tensorboard helper printed no answer (got {stdout.strip()[-200:]!r})")


def parse_start(stdout: str) -> Board:
    data = _last_json(stdout)
    return Board(port=int(data["port"]), pid=int(data["pid"]), reused=bool(data["reused"]), token=str(data["token"]))


def _helper(transport: Transport, profile: ClusterProfile, argv: list[str], what: str, timeout: float) -> str:
    done = transport.run(argv, timeout=timeout, stdin=HELPER.read_bytes())
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        last = detail[-1] if detail else f"exit code {done.returncode}"
        raise ClusterError(
            f"could not {what} TensorBoard on {profile.name}: {last} (is tensorboard installed in "
            f"the environment the profile's setup lines activate?)"
        )
    return done.stdout


def start(transport: Transport, profile: ClusterProfile, runs: Sequence[tuple[str, str]]) -> Board:
    """Serve `runs` ((label, run dir) pairs) in one TensorBoard."""
    return parse_start(_helper(transport, profile, start_argv(profile, runs), "start", 180))


def stop_servers(transport: Transport, profile: ClusterProfile, *select: str) -> list[Stopped]:
    """Stop this user's servers on the login node: `--pid PID`, `--all`, or those serving any of these labels.

    The helper signals a pid only while it is still the server its state dir recorded (same start time,
    same argv): a pid reused by another process is never touched."""
    out = _last_json(_helper(transport, profile, helper_argv(profile, "stop", *select), "stop", 60))
    return [Stopped(int(s["pid"]), tuple(str(r) for r in s.get("runs") or ())) for s in out.get("stopped", [])]


def stop(transport: Transport, profile: ClusterProfile, board: Board) -> bool:
    """Stop the server this command started; False when it was already gone."""
    return any(s.pid == board.pid for s in stop_servers(transport, profile, "--pid", str(board.pid)))


def ssh_hint(port: int, local_port: Optional[int] = None) -> str:
    """What a user on a laptop runs to reach a TensorBoard on this login node (then opens the token URL)."""
    host = socket.getfqdn() or socket.gethostname()
    return f"ssh -N -L {local_port or port}:127.0.0.1:{port} {getpass.getuser()}@{host}"


def is_local(transport: Transport) -> bool:
    return isinstance(transport, LocalTransport)
