"""`meshrun watch [JOB...] --notify CMD`: follow jobs and run a command once for each new alert, and once for
each failure, requeue or hang with the digest a person needs.

Each refresh is one `statuses` call: one round trip per cluster, which already brings every job's newest
alerts. A new alert is printed and handed to the notify command as one JSON object on its stdin (the
alert record plus "job_id", "cluster" and "name"); the command is an argv list, never a shell line. A job
that fails, is requeued or hangs gets one more notification, its `digest` (`digest()`): what happened, the
verdict and the node blamed, the newest checkpoint, a loss sparkline, the goodput so far and the commands
to look, resume or cancel.
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

from meshrun.launcher.contract.private import make_private_dir
from meshrun.submit.core.registry import JobRecord
from meshrun.submit.core.state import FINAL, JobState
from meshrun.submit.core.status import Status
from meshrun.submit.errors import InputError
from meshrun.submit.folders import state_dir

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


DIGEST_EVENTS = ("failed", "requeued", "hang")


def events_of(status: Status, first_restarts: Optional[int]) -> list[str]:
    """Which digest events this refresh shows for the job: it ended FAILED or TIMEOUT, Slurm restarted it since
    watch first saw it (`first_restarts`), a hang was diagnosed."""
    events = []
    if status.done and status.state in (JobState.FAILED, JobState.TIMEOUT):
        events.append("failed")
    if first_restarts is not None and status.restarts > first_restarts:
        events.append("requeued")
    if status.verdict is not None or any(a.get("rule") == "hang" for a in status.alerts):
        events.append("hang")
    return events


def digest(status: Status, event: str) -> dict[str, Any]:
    """One notification's worth of a failure, requeue or hang: JSON-ready, with `text`, its lines for a person."""
    from meshrun.submit.views.tables import goodput_line
    from meshrun.submit.views.top import sparkline

    verdict = status.verdict or {}
    ranks = [r for r in verdict.get("ranks") or [] if isinstance(r, dict)]
    blamed = sorted({str(r["node"]) for r in ranks if r.get("state") == "stalled" and r.get("node")})
    hang = next((a for a in reversed(status.alerts) if a.get("rule") == "hang"), None)
    if not blamed and hang is not None and hang.get("node"):
        blamed = [str(hang["node"])]
    first_sentence = str(verdict.get("verdict") or (hang or {}).get("message") or "").split(". ")[0].strip()
    checkpoint = status.progress.get("checkpoint_step")
    what = {
        "failed": f"ended {status.state.value}" + (f": {status.reason}" if status.reason else ""),
        "requeued": f"requeued (restart {status.restarts})" + (f": {status.reason}" if status.reason else ""),
        "hang": "hung" + (f": {first_sentence}" if first_sentence else ""),
    }[event]
    commands = {"status": f"meshrun status {status.job_id}", "logs": f"meshrun logs {status.job_id}"}
    if status.verdict is not None:
        commands["diagnosis"] = f"meshrun logs {status.job_id} --diagnosis"
    if status.done and checkpoint is not None:
        commands["resume"] = f"meshrun resume {status.job_id}"
    if not status.done:
        commands["cancel"] = f"meshrun cancel {status.job_id}"
    record: dict[str, Any] = {
        "event": event,
        "job_id": status.job_id,
        "cluster": status.cluster,
        "name": status.name,
        "state": status.state.value,
        "what": what,
        "verdict": first_sentence or None,
        "blamed_nodes": blamed,
        "step": status.progress.get("step"),
        "checkpoint_step": checkpoint,
        "losses": sparkline(status.losses) or None,
        "goodput": status.goodput,
        "commands": commands,
    }
    lines = [f"{status.job_id} ({status.cluster}, {status.name}) {what}"]
    lines += [f"  blamed: {', '.join(blamed)}"] if blamed else []
    lines.append(
        f"  step {record['step'] if record['step'] is not None else '-'}, newest checkpoint "
        + (f"step {checkpoint}" if checkpoint is not None else "none")
        + (f", loss {record['losses']}" if record["losses"] else "")
    )
    lines += (
        [f"  {goodput_line(status.goodput, trainer=status.steps is not None, ended=status.done)}"]
        if status.goodput
        else []
    )
    lines += [f"  {name}: {command}" for name, command in commands.items() if name in ("diagnosis", "resume", "cancel")]
    record["text"] = "\n".join(lines)
    return record


def _hang_moment(status: Status) -> Any:
    """Which hang it is (its verdict's time, else its alert's): a verdict still shown after the requeue it
    caused is the same hang, not a new one."""
    if status.verdict is not None and status.verdict.get("time") is not None:
        return status.verdict.get("time")
    return next((a.get("time") for a in reversed(status.alerts) if a.get("rule") == "hang"), None)


def handle_digests(
    found: Sequence[Status],
    first_restarts: dict[str, int],
    seen: Seen,
    argv: Optional[Sequence[str]],
    out: TextIO,
) -> int:
    """One digest per failure, requeue (per restart) and hang of each job, claimed like alerts: never twice."""
    from meshrun.submit.core.status import warn_to_stderr

    pending = []
    for status in found:
        first_restarts.setdefault(f"{status.cluster}/{status.job_id}", status.restarts)
        for event in events_of(status, first_restarts[f"{status.cluster}/{status.job_id}"]):
            moment = {"failed": status.state.value, "requeued": status.restarts, "hang": _hang_moment(status)}[event]
            key = hashlib.sha256(json.dumps([status.cluster, status.job_id, event, moment]).encode()).hexdigest()[:32]
            pending.append((status, event, key))
    new = set(seen.claim([key for _, _, key in pending]))
    for status, event, key in pending:
        if key not in new:
            continue
        new.discard(key)
        record = digest(status, event)
        out.write(record["text"] + "\n")
        out.flush()
        if argv:
            run_notify(argv, json.dumps(record).encode() + b"\n", warn_to_stderr)
    return len(pending)


def handle(found: Sequence[Status], seen: Seen, argv: Optional[Sequence[str]], out: TextIO) -> int:
    """Print and notify every alert not claimed before; how many were new."""
    from meshrun.submit.core.status import warn_to_stderr
    from meshrun.submit.views.tables import alert_line

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
    first_restarts: dict[str, int] = {}
    while True:
        found = refresh(records, clusters, registry, live=True)  # live: the losses and goodput a digest shows
        if found is None:
            time.sleep(interval)
            continue
        handle(found, seen, argv, out)
        handle_digests(found, first_restarts, seen, argv, out)
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


def refresh(records: Sequence[Any], clusters: Any, registry: Any, live: bool = False) -> Optional[list[Any]]:
    """One status refresh for a loop that follows jobs; None when a connection was lost (closed:
    the next refresh reconnects)."""
    from meshrun.submit import api
    from meshrun.submit.errors import ConnectionLost

    try:
        found: list[Any] = api.statuses(records, clusters, registry, live=live)
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
