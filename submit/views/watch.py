"""`meshrun watch [JOB...] --notify CMD`: follow jobs and run a command once for each new alert.

Each refresh is one `statuses` call: one round trip per cluster, which already brings every job's newest
alerts. A new alert is printed and handed to the notify command as one JSON object on its stdin (the
alert record plus "job_id", "cluster" and "name"); the command is an argv list, never a shell line.
What was notified is kept in the user's state dir ($XDG_STATE_HOME/meshrun/alerts-notified.json),
recorded before the command runs: an alert is never notified twice, even across a restart of watch
or by two watches at once (a lock), at the price of a lost one if watch dies in between.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

from launcher.contract.private import make_private_dir
from submit.config.folders import state_dir
from submit.errors import InputError
from submit.jobs.registry import JobRecord
from submit.jobs.state import FINAL, JobState
from submit.jobs.status import Status

KEEP = 50_000
"""The notified set keeps this many newest keys (a few MB at most)."""
NOTIFY_TIMEOUT_S = 60.0


def seen_path() -> Path:
    return state_dir() / "alerts-notified.json"


def alert_key(status: Status, alert: dict[str, Any]) -> str:
    """One alert of one job, whatever refresh brought it (its record is written once, never changed)."""
    text = json.dumps([status.cluster, status.job_id, alert], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def payload(status: Status, alert: dict[str, Any]) -> bytes:
    """What the notify command reads on stdin: the alert record, and which job it is (one JSON line, ended
    by a newline as a line-reading program expects)."""
    record = {**alert, "job_id": status.job_id, "cluster": status.cluster, "name": status.name}
    return json.dumps(record).encode() + b"\n"


class Seen:
    """The notified alerts' keys, in a private file, changed under an exclusive lock."""

    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = path or seen_path()
        make_private_dir(self.path.parent)

    def claim(self, keys: Sequence[str]) -> list[str]:
        """Of `keys`, those never claimed before, now recorded as claimed (one lock, one atomic write)."""
        with open(str(self.path) + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            known = self._read()
            new = [k for k in dict.fromkeys(keys) if k not in known]
            if new:
                self._write([*known, *new][-KEEP:])
            return new

    def _read(self) -> dict[str, None]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return dict.fromkeys(k for k in data if isinstance(k, str)) if isinstance(data, list) else {}

    def _write(self, keys: list[str]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(keys, handle)
        os.replace(tmp, self.path)


def notify_argv(option: Optional[str], configured: Optional[Sequence[str]]) -> Optional[list[str]]:
    """--notify (split as a shell would split words, but never run by one), else the user's config."""
    import shlex

    if option is not None:
        try:
            argv = shlex.split(option)
        except ValueError as exc:
            raise InputError("--notify", option, f"cannot split it into words ({exc}); check the quotes") from None
        if not argv:
            raise InputError("--notify", option, "give a command, e.g. --notify 'notify-send meshrun'")
    elif configured:
        argv = list(configured)
    else:
        return None
    if shutil.which(argv[0]) is None:
        where = "--notify" if option is not None else "notify (in ~/.config/meshrun/config.yaml)"
        raise InputError(where, argv[0], _not_runnable(argv[0]))
    return argv


def _not_runnable(program: str) -> str:
    """Why `program` cannot be run, and the fix: a path is taken as it is, a bare name is looked up on PATH."""
    if os.sep not in program:
        return "no such program on PATH; give its full path, or install it"
    if os.path.isdir(program):
        return "a folder, not a program; give the program's path"
    if not os.path.exists(program):
        return "no such file; check the path"
    return f"not executable; `chmod u+x {program}`, or give its interpreter first (e.g. 'sh {program}')"


def run_notify(argv: Sequence[str], data: bytes, warn: Callable[[str], None]) -> None:
    try:
        done = subprocess.run(list(argv), input=data, timeout=NOTIFY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warn(f"the notify command {argv[0]} failed: {exc}")
        return
    if done.returncode != 0:
        warn(f"the notify command {argv[0]} exited {done.returncode}")


def running_records(registry: Any, limit: int = 200) -> list[JobRecord]:
    """The registry's jobs not known to have ended (`statuses` then says which still run)."""
    return [r for r in registry.recent(limit) if r.last_state not in FINAL]


def handle(found: Sequence[Status], seen: Seen, argv: Optional[Sequence[str]], out: TextIO) -> int:
    """Print and notify every alert not claimed before; how many were new."""
    from submit.jobs.status import warn_to_stderr
    from submit.views.tables import alert_line

    pending = [(s, a, alert_key(s, a)) for s in found for a in s.alerts]
    new = set(seen.claim([key for _, _, key in pending]))
    count = 0
    for status, alert, key in pending:
        if key not in new:
            continue
        new.discard(key)  # the same record twice in one tail: once
        count += 1
        out.write(f"{status.job_id} ({status.cluster}) ALERT {alert_line(alert)}\n")
        out.flush()
        if argv:
            run_notify(argv, payload(status, alert), warn_to_stderr)
    return count


def follow(
    records: Sequence[JobRecord],
    clusters: Any,
    registry: Any,
    argv: Optional[Sequence[str]],
    interval: float = 2.0,
    out: Optional[TextIO] = None,
    seen: Optional[Seen] = None,
) -> int:
    """Refresh every `interval` s until every job is done (or unreachable); 0, or 1 if one was unreachable."""
    out, seen = out or sys.stdout, seen or Seen()
    ids = ", ".join(dict.fromkeys(r.job_id for r in records))
    print(f"meshrun: watching {len(records)} job(s) until they end ({ids}); Ctrl-C stops watching", file=sys.stderr)
    ended: set[str] = set()
    while True:
        found = refresh(records, clusters, registry)
        if found is None:
            time.sleep(interval)
            continue
        handle(found, seen, argv, out)
        report_ends(found, ended, out)
        if all(s.done or s.state == JobState.UNREACHABLE for s in found):
            return watch_end(found)
        time.sleep(interval)


def report_ends(found: Sequence[Status], ended: set[str], out: TextIO) -> None:
    """One line for each job that ended since the last refresh: what a person following jobs waits for."""
    for status in found:
        if status.done and status.job_id not in ended:
            ended.add(status.job_id)
            why = f": {status.reason}" if status.reason and not status.succeeded else ""
            out.write(f"{status.job_id} ({status.cluster}) ended {status.state.value}{why}\n")
            out.flush()


def refresh(records: Sequence[Any], clusters: Any, registry: Any) -> Optional[list[Any]]:
    """One status refresh for a loop that follows jobs; None when a connection was lost (closed:
    the next refresh reconnects)."""
    from submit import api
    from submit.errors import ConnectionLost

    try:
        found: list[Any] = api.statuses(records, clusters, registry)
    except ConnectionLost:
        clusters.close()
        return None
    return found


def watch_end(found: Sequence[Any]) -> int:
    """Nothing is left to watch: every job ended or sits on a cluster that cannot be reached now
    (waiting for it would never return)."""
    lost = [s for s in found if s.state == JobState.UNREACHABLE]
    if not lost:
        return 0
    clusters = sorted({s.cluster for s in lost})
    print(
        f"meshrun: {len(lost)} job(s) on {', '.join(clusters)} could not be reached; "
        f"`meshrun status` again once the cluster answers",
        file=sys.stderr,
    )
    return 1
