"""TensorBoard for one or more runs, on the login node (a standalone script: stdlib + tensorboard only).

`meshrun tb` copies this file to ~/.cache/meshrun/tb/ on the login node and runs it there, in
the cluster's environment (the profile's setup lines):

    python tbserve.py start LABEL RUN_DIR [LABEL RUN_DIR ...]   # reuse a live server of these runs or start
                                                              # one; prints {"port", "pid", "reused", "dir", "token"}
    python tbserve.py stop --pid PID | --all | LABEL...        # stop servers (checked to be ours first);
                                                              # prints {"stopped": [{"pid", "runs"}...]}
    python tbserve.py serve STATE_DIR                          # (what start spawns) the server itself

Each set of runs gets a state dir (~/.cache/meshrun/tb/KEY, KEY from the labels and run dirs, 0700)
holding server.json, token, server.log and runs/LABEL: a link to the run's own event files
(RUN_DIR/tensorboard/, written by the job), or, for an old run that wrote none, a folder the
server fills from its metrics.jsonl as the job writes it. TensorBoard reads runs/, so each run
is named by its label (a job id, a sweep task's id). The state lives outside the work dir, so
`tensorboard --logdir WORK_DIR` never shows a run twice.

Privacy: the server binds 127.0.0.1 only (reached through an SSH tunnel), but loopback is shared by
every user of the login node (and the tunnel's local end by every user of the laptop), so every
request must carry this server's secret: a random token (the `token` file, 0600, never in any argv)
given once as `?token=` in the URL `meshrun tb` prints, which answers with a redirect setting a cookie
(HttpOnly, named per server: cookies do not tell ports apart); anything else gets 403 before it reaches
TensorBoard. The server stops on SIGTERM, or by itself after MAX_HOURS.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import hmac
import http.cookies
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

SERVER_FILE = "server.json"
TOKEN_FILE = "token"
CLAIM_FILE = "claimed"
"""The pid of the server whose URL reached `meshrun tb` (a server nobody claimed stops itself)."""
COOKIE_PREFIX = "meshrun-tb-"
RUNS = "runs"
CONVERTED = "converted.json"
"""Which labels the server converts from metrics.jsonl (the rest link to the job's own event files)."""
EVENTS = "events.out.tfevents.*"
EVENTS_SUFFIX = ".meshrun"
"""The converter's event files (older meshrun wrote them into RUN_DIR/tensorboard/ too)."""
MAX_HOURS = 24.0
START_TIMEOUT_S = 90.0
STOP_WAIT_S = 10.0


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def start_time(pid: int) -> Optional[int]:
    """The kernel's start time of a live process (field 22 of /proc/PID/stat), None if gone or a zombie.

    A pid alone may name another process by the time it is read back (pids are reused): a pid plus
    its start time names one process for as long as it lives."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def is_server(pid: int, started: Any, state: Path) -> bool:
    """pid is still the server this state dir recorded: the same start time, argv `... tbserve.py serve STATE`."""
    if not isinstance(started, int) or start_time(pid) != started:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().rstrip(b"\0").split(b"\0")
    except OSError:
        return False
    wanted = [b"serve", os.fsencode(str(state))]
    # `PYTHON .../tbserve.py serve STATE` (older meshrun added the port after it)
    return any(arg.endswith(b"tbserve.py") and argv[i + 1 : i + 3] == wanted for i, arg in enumerate(argv))


def _read_server(state: Path) -> Optional[dict[str, Any]]:
    try:
        server = json.loads((state / SERVER_FILE).read_text())
        return server if isinstance(server, dict) and isinstance(server.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _recorded(state: Path) -> Optional[dict[str, Any]]:
    """The live, answering server of this state dir with its token; None if there is none."""
    server = _read_server(state)
    if server is None or not is_server(server["pid"], server.get("started"), state):
        return None
    try:
        token = (state / TOKEN_FILE).read_text().strip()
    except OSError:
        return None
    if not token or not _answers(int(server["port"])):
        return None
    return {"port": int(server["port"]), "pid": server["pid"], "token": token}


def new_token() -> str:
    """256 random bits, URL- and cookie-safe. (Not the `secrets` module: run from a checkout, this script's
    folder comes first on sys.path, and submit/core/secrets.py is meshrun's own.)"""
    return base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")


def _base() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshrun" / "tb"


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600 from its creation on, whatever the umask), atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o600)
        handle.write(text)
    os.replace(tmp, path)


def writes_events(run_dir: Path) -> bool:
    """The job writes its own event files (meshrun's trainer and report() do), or has not logged yet."""
    own = [p for p in glob.glob(str(run_dir / "tensorboard" / EVENTS)) if not p.endswith(EVENTS_SUFFIX)]
    return bool(own) or not (run_dir / "metrics.jsonl").exists()


def state_dir(runs: list[tuple[str, Path]]) -> Path:
    base = _base()
    key = hashlib.sha256(json.dumps([[label, str(path)] for label, path in runs]).encode()).hexdigest()[:16]
    return base / key


def prepare(state: Path, runs: list[tuple[str, Path]]) -> list[str]:
    """runs/LABEL for each run (a link to its event files, or a folder to convert into); the converted labels."""
    tree = state / RUNS
    tree.mkdir(mode=0o700, parents=True, exist_ok=True)
    converted = []
    for label, run_dir in runs:
        entry = tree / label
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        elif entry.is_dir():
            for old in entry.glob(EVENTS):
                old.unlink()  # rebuilt from the start: a restarted server must not show points twice
        if writes_events(run_dir):
            if entry.is_dir():
                entry.rmdir()
            entry.symlink_to(run_dir / "tensorboard", target_is_directory=True)
        else:
            entry.mkdir(mode=0o700, exist_ok=True)
            converted.append(label)
    (state / CONVERTED).write_text(json.dumps({label: str(path) for label, path in runs if label in converted}))
    return converted


def start(runs: list[tuple[str, Path]]) -> dict[str, Any]:
    """Reuse the live server of these runs, or start one with a new token; what `meshrun tb` needs to reach it."""
    state = state_dir(runs)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    server = _recorded(state)
    if server is not None:
        return {**server, "reused": True, "dir": str(state)}
    retire(state)  # one left from an older meshrun (no token: open to every user) or not answering
    prepare(state, runs)
    (state / SERVER_FILE).unlink(missing_ok=True)
    _write_private(state / TOKEN_FILE, new_token())
    with open(state / "server.log", "ab") as log:
        os.fchmod(log.fileno(), 0o600)
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve", str(state)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # outlives this SSH session
    deadline = time.monotonic() + START_TIMEOUT_S
    while (server := _recorded(state)) is None or server["pid"] != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"tensorboard did not start; see {state / 'server.log'}")
        time.sleep(0.2)
    return {**server, "reused": False, "dir": str(state)}


def retire(state: Path) -> bool:
    """Stop the server this state dir records, if that pid is still it (same start time, same argv)."""
    server = _read_server(state)
    if server is None:
        return False
    pid, started = server["pid"], server.get("started")
    if started is None:  # recorded by an older meshrun (no start time): the argv alone says it is ours
        started = start_time(pid)
    if not is_server(pid, started, state):
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if is_server(pid, started, state):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
        deadline = time.monotonic() + STOP_WAIT_S
        while is_server(pid, started, state) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not is_server(pid, started, state):
            break
    (state / SERVER_FILE).unlink(missing_ok=True)
    return True


def stop(select: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """Stop each of this user's servers whose record `select` picks; the ones stopped ({pid, runs})."""
    base = _base()
    stopped = []
    for state in sorted(base.iterdir()) if base.is_dir() else []:
        server = _read_server(state)
        if server is not None and state.is_dir() and select(server) and retire(state):
            stopped.append({"pid": server["pid"], "runs": server.get("runs") or _labels(state)})
    return stopped


def _labels(state: Path) -> list[str]:
    try:
        return sorted(entry.name for entry in (state / RUNS).iterdir())
    except OSError:
        return []


class Gate:
    """WSGI middleware in front of TensorBoard: only a request carrying this server's token gets through.

    `?token=T` on any URL answers a redirect to the same URL without it, setting the cookie (so the token
    leaves the address bar and the browser's later requests carry the cookie); a request with neither
    gets 403 and not a byte of TensorBoard."""

    def __init__(self, app: Callable[..., Any], token: str) -> None:
        self.app, self.token = app, token
        self.cookie = COOKIE_PREFIX + hashlib.sha256(token.encode()).hexdigest()[:12]

    def _ok(self, given: Optional[str]) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        query = urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        given = [value for key, value in query if key == "token"]
        if given and self._ok(given[-1]):
            rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "token"])
            raw = (environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")).encode("latin-1")  # WSGI's bytes
            path = "/" + urllib.parse.quote(raw).lstrip("/")  # never `//host`: a redirect stays on this server
            start_response(
                "302 Found",
                [
                    ("Location", path + (f"?{rest}" if rest else "")),
                    ("Set-Cookie", f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Lax"),
                    ("Cache-Control", "no-store"),
                    ("Content-Length", "0"),
                ],
            )
            return [b""]
        if self._ok(self._cookie(environ.get("HTTP_COOKIE", ""))):
            return self.app(environ, start_response)  # type: ignore[no-any-return]
        body = b"meshrun tb: open the URL `meshrun tb` printed (it carries this server's token)\n"
        start_response(
            "403 Forbidden", [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
        )
        return [body]

    def _cookie(self, header: str) -> Optional[str]:
        jar: http.cookies.SimpleCookie = http.cookies.SimpleCookie()
        try:
            jar.load(header)
        except http.cookies.CookieError:
            return None
        morsel = jar.get(self.cookie)
        return morsel.value if morsel is not None else None


class Bridge:
    """An old run's metrics.jsonl -> TensorBoard scalar events, incrementally (complete lines only)."""

    def __init__(self, metrics: Path, out_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.metrics, self.offset = metrics, 0
        self.writer = EventFileWriter(str(out_dir), flush_secs=1, filename_suffix=EVENTS_SUFFIX)

    def poll(self) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        try:
            with open(self.metrics, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                row = json.loads(line)
                step = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            values = [
                summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                for k, v in row.items()
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            self.writer.add_event(
                event_pb2.Event(
                    wall_time=float(row.get("time") or time.time()),
                    step=step,
                    summary=summary_pb2.Summary(value=values),
                )
            )
        if complete:
            self.writer.flush()


def serve(state: Path) -> None:
    from tensorboard import program

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    starter = os.getppid()  # the `start` that spawned this server, until it claims it
    token = (state / TOKEN_FILE).read_text().strip()
    converted = json.loads((state / CONVERTED).read_text())
    bridges = [Bridge(Path(run_dir) / "metrics.jsonl", state / RUNS / label) for label, run_dir in converted.items()]
    for bridge in bridges:
        bridge.poll()
    servers: list[Any] = []

    def guarded(wsgi_app: Any, flags: Any) -> Any:
        servers.append(program.WerkzeugServer(Gate(wsgi_app, token), flags))
        return servers[-1]

    board = program.TensorBoard(server_class=guarded)
    board.configure(
        argv=[
            "tensorboard",
            "--logdir",
            str(state / RUNS),
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # the kernel picks a free port as it binds: no window for another user to take it first
            "--reload_interval",
            "2",
            "--load_fast",
            "false",
        ]
    )
    board.launch()  # serves from a background thread
    me = {"port": servers[0].server_port, "pid": os.getpid(), "started": start_time(os.getpid())}
    _write_private(state / SERVER_FILE, json.dumps({**me, "runs": _labels(state)}))
    stop_at = time.monotonic() + MAX_HOURS * 3600
    try:
        while time.monotonic() < stop_at and not _abandoned(state, starter):
            for bridge in bridges:
                bridge.poll()
            time.sleep(1.0)
    finally:
        if (_read_server(state) or {}).get("pid") == os.getpid():
            (state / SERVER_FILE).unlink(missing_ok=True)


def _abandoned(state: Path, starter: int) -> bool:
    """The `start` that spawned this server died before handing its URL to `meshrun tb` (a Ctrl-C or a
    closed terminal while TensorBoard loaded: meshrun kills it), so nobody knows to stop this server."""
    if os.getppid() == starter:
        return False  # still starting (or, reparented to it, already claimed: checked below all the same)
    try:
        return (state / CLAIM_FILE).read_text().strip() != str(os.getpid())
    except OSError:
        return True


def _stop_selector(args: list[str]) -> Optional[Callable[[dict[str, Any]], bool]]:
    if args == ["--all"]:
        return lambda server: True
    if len(args) == 2 and args[0] == "--pid" and args[1].isdigit():
        return lambda server: server["pid"] == int(args[1])
    if args and not any(a.startswith("-") for a in args):
        return lambda server: bool(set(server.get("runs") or ()) & set(args))
    return None


def main(argv: list[str]) -> int:
    os.umask(0o077)  # the state, token, log and converted events are the user's alone, whatever the umask
    if len(argv) >= 3 and argv[0] == "start" and len(argv) % 2 == 1:
        runs = [(argv[i], Path(argv[i + 1])) for i in range(1, len(argv), 2)]
        found = start(runs)
        try:
            print(json.dumps(found), flush=True)
        except BrokenPipeError:  # meshrun tb went away while it started: nobody will stop this server
            if not found["reused"]:
                retire(Path(found["dir"]))
            return 1
        _write_private(Path(found["dir"]) / CLAIM_FILE, str(found["pid"]))  # meshrun tb has it: it stops it
        return 0
    if argv[:1] == ["stop"] and (select := _stop_selector(argv[1:])) is not None:
        print(json.dumps({"stopped": stop(select)}), flush=True)
        return 0
    if len(argv) == 2 and argv[0] == "serve":
        serve(Path(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
