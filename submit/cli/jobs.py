"""The verbs on submitted jobs (status, logs, cancel; tb is cli_tb.py) and `trust`: registry first, then the job's cluster.

Each reaches a cluster through one `api.Clusters` connection for the whole command.
Heavy imports (paramiko, the follower) happen inside the verbs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Optional, Sequence

from submit.errors import InputError

WATCH_FIRST_S, WATCH_MAX_S = 2.0, 30.0
DETAIL_ALERTS = 10
"""`status JOB` lists this many of the newest alerts."""


def _clock(seconds: Any) -> str:
    seconds = int(seconds or 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned in terminal cells (a wide or emoji name takes two per character), values printable."""
    from submit.views.textwidth import display_width, ljust, printable

    cells = [[printable(str(c)) for c in row] for row in rows]
    widths = [max(display_width(r[i]) for r in cells) for i in range(len(cells[0]))]
    return "".join("  ".join(ljust(c, w) for c, w in zip(row, widths)).rstrip() + "\n" for row in cells)


def status_table(found: Sequence[Any]) -> str:
    notes = [finding_note(s) for s in found]
    noted = any(notes)  # the NOTE column only when a job has something to say: the table stays narrow
    alerted = any(s.alerts for s in found)  # the ALERTS column likewise
    rows = [
        (
            "JOB",
            "CLUSTER",
            "NAME",
            "STATE",
            "STEP",
            "LOSS",
            "RESTARTS",
            "CKPT",
            "ELAPSED",
            *alerted * ("ALERTS",),
            *noted * ("NOTE",),
            "RUN DIR",
        )
    ]
    for s, note in zip(found, notes):
        loss = s.progress.get("loss")
        rows.append(
            (
                s.job_id,
                s.cluster,
                s.name,
                s.state,
                str(s.progress.get("step", "-")),
                f"{loss:.4f}" if isinstance(loss, (int, float)) else "nan" if "loss" in s.progress else "-",
                str(s.restarts),
                str(s.progress.get("checkpoint_step", "-")),
                _clock(s.elapsed_s) if s.elapsed_s is not None else "-",
                *alerted * (alerts_note(s.alerts),),
                *noted * (note or "-",),
                s.run_dir,
            )
        )
    return table(rows)


def alerts_note(alerts: Sequence[dict[str, Any]]) -> str:
    """The ALERTS cell: how many, and the newest one's rule ("2 loss_spike"); "-" when none."""
    return f"{len(alerts)} {alerts[-1].get('rule')}" if alerts else "-"


def alert_line(alert: dict[str, Any]) -> str:
    """One alert for a person: when, the rule, where, the message."""
    from submit.views.textwidth import printable

    where = "".join(f" {key} {alert[key]}" for key in ("step", "rank", "node") if alert.get(key) is not None)
    return printable(f"{_when(alert.get('time'))} {alert.get('rule')}{where}: {alert.get('message', '')}".strip())


def finding_note(status: Any) -> str:
    """The list view's short marker of what the sidecars found ("" when nothing)."""
    notes = []
    if status.verdict is not None:
        step = status.verdict.get("step")
        notes.append(f"hang at step {step}" if isinstance(step, int) else "hang")
    if status.stragglers:
        notes.append(f"{len(status.stragglers)} straggler{'s' if len(status.stragglers) > 1 else ''}")
    return ", ".join(notes)


def _when(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):
        return ""


def _hang_head(verdict: dict[str, Any]) -> str:
    """When the hang was declared, and in which attempt (a requeued job has several); the paragraph says the rest."""
    attempt = verdict.get("attempt")
    parts = [_when(verdict.get("time")), f"attempt {attempt}" if isinstance(attempt, str) and attempt else ""]
    return ", ".join(p for p in parts if p)


def detail_lines(status: Any, width: int = 100) -> list[str]:
    """One job's findings under its table row: the engine, the hang's verdict, stragglers, environment mismatches."""
    import textwrap

    from submit.views.textwidth import printable

    lines = [f"engine: {printable(status.engine)}"] if status.engine else []
    if status.verdict is not None:
        lines.append(printable(f"hang: {_hang_head(status.verdict)}".rstrip(": ")))
        paragraph = printable(" ".join(str(status.verdict.get("verdict") or "").split()))
        lines += textwrap.wrap(paragraph, width, initial_indent="  ", subsequent_indent="  ")
        lines.append(f"  the diagnosis: meshrun logs {status.job_id} --diagnosis")
    if status.stragglers:
        named = [
            f"rank {s['rank']} ({s.get('node', '?')}) {float(s['ratio']):.1f}x"
            + (" the median busy time" if not i else "")
            for i, s in enumerate(status.stragglers)
        ]
        lines.append(printable("stragglers: " + ", ".join(named)))
    lines += [printable(f"environment: {line}") for line in status.env_mismatches]
    if status.best_checkpoint is not None:
        best = status.best_checkpoint
        lines.append(
            f"best checkpoint: step {best['step']}, val_loss {best['val_loss']:.4f} "
            f"(meshrun export {status.job_id} --best)"
        )
    if status.alerts:
        lines.append(f"alerts ({len(status.alerts)} recent, newest last; all: {status.run_dir}/alerts.jsonl):")
        lines += [f"  {alert_line(a)}" for a in status.alerts[-DETAIL_ALERTS:]]
    return lines


def _records(args: argparse.Namespace, registry: Any) -> list[Any]:
    if not args.jobs:
        recent: list[Any] = registry.recent(args.limit, args.cluster)
        return recent
    return [r for job in args.jobs for r in registry.find_all(job, args.cluster)]


def cmd_status(args: argparse.Namespace) -> int:
    from submit import api
    from submit.jobs.registry import Registry

    registry = Registry()
    records = _records(args, registry)
    detail = bool(args.jobs) and len(records) == 1  # one job asked for by id: its detail view
    clusters = api.Clusters()
    try:
        if args.watch:
            return watch(records, clusters, registry, args.json)
        found = api.statuses(records, clusters, registry, detail=detail)
        best = _best_checkpoint(records[0], clusters) if detail and found else None
    finally:
        clusters.close()
    if best is not None:
        found = [dataclasses.replace(found[0], best_checkpoint={"step": best[0], "val_loss": best[1]})]
    if args.json:
        sys.stdout.write(json.dumps([s.as_json() for s in found], indent=2) + "\n")
    else:
        sys.stdout.write(
            status_table(found) + "".join(f"{line}\n" for f in found if detail for line in detail_lines(f))
        )
    return 0


def _best_checkpoint(record: Any, clusters: Any) -> Optional[tuple[int, float]]:
    """The job's best checkpoint (checkpoint.keep_best) for its detail view: two more commands, one job only."""
    from submit.errors import ClusterError, InputError
    from submit.jobs.checkpoints import best_checkpoint, checkpoint_dir

    try:
        transport = clusters.transport_for(record)
        return best_checkpoint(transport, checkpoint_dir(record, transport))
    except (ClusterError, InputError, OSError):
        return None  # the detail view shows what it has; `meshrun export --best` says why


def refresh(records: Sequence[Any], clusters: Any, registry: Any) -> Optional[list[Any]]:
    """One status refresh for a loop that follows jobs; None when a connection was lost (closed:
    the next refresh reconnects)."""
    from submit import api
    from submit.transport.base import ConnectionLost

    try:
        found: list[Any] = api.statuses(records, clusters, registry)
    except ConnectionLost:
        clusters.close()
        return None
    return found


def watch(records: Sequence[Any], clusters: Any, registry: Any, as_json: bool) -> int:
    """Refresh until every job is done: one round trip per cluster each time, backing off
    (2 s, growing to 30 s) while nothing changes; a terminal is redrawn, a pipe gets changes only."""

    tty, interval, last = sys.stdout.isatty(), WATCH_FIRST_S, None
    while True:
        found = refresh(records, clusters, registry)
        if found is None:
            time.sleep(interval)
            continue
        key = [(s.job_id, s.state, s.progress.get("step")) for s in found]
        changed, last = key != last, key
        interval = WATCH_FIRST_S if changed else min(interval * 1.5, WATCH_MAX_S)
        if as_json and changed:
            sys.stdout.write(json.dumps([s.as_json() for s in found]) + "\n")
        elif tty:
            sys.stdout.write("\x1b[H\x1b[2J" + status_table(found) + f"\n(refresh in {interval:.0f} s; Ctrl-C stops)\n")
        elif changed:
            sys.stdout.write(status_table(found) + "\n")
        sys.stdout.flush()
        if all(s.done or s.state == "UNREACHABLE" for s in found):
            return _watch_end(found)
        time.sleep(interval)


def _watch_end(found: Sequence[Any]) -> int:
    """Nothing is left to watch: every job ended or sits on a cluster that cannot be reached now
    (waiting for it would never return)."""
    lost = [s for s in found if s.state == "UNREACHABLE"]
    if not lost:
        return 0
    clusters = sorted({s.cluster for s in lost})
    print(
        f"meshrun: {len(lost)} job(s) on {', '.join(clusters)} could not be reached; "
        f"`meshrun status` again once the cluster answers",
        file=sys.stderr,
    )
    return 1


def _one_job(registry: Any, job: str, cluster: Any) -> Any:
    records = registry.find_all(job, cluster)
    if len(records) > 1:
        raise InputError(
            "JOB",
            job,
            f"a job array of {len(records)} tasks; pick one, e.g. {records[0].job_id} "
            f"(`meshrun status {job}` lists them)",
        )
    return records[0]


def cmd_logs(args: argparse.Namespace) -> int:
    from submit import api
    from submit.jobs.registry import Registry
    from submit.views import logs

    record = _one_job(Registry(), args.job, args.cluster)
    clusters = api.Clusters()
    try:
        transport = clusters.transport_for(record)
        if getattr(args, "diagnosis", False):
            return _print_diagnosis(transport, record)
        if args.batch:
            sources = [logs.Source(api.log_path(record, None))]
        else:
            ranks = logs.select_ranks(transport, record, args.rank)
            labels = len(ranks) > 1
            sources = [logs.Source(api.log_path(record, r), f"[rank {r}] ".encode() if labels else b"") for r in ranks]
        printer = logs.Printer(sys.stdout.buffer, merged=len(sources) > 1)
        if args.follow:
            logs.Follower(record, clusters, sources, printer, sys.stderr).run()
        else:
            logs.print_once(transport, sources, printer)
        transport = clusters.transport_for(record)  # after a reconnect, the new connection
        if all(s.offset == 0 for s in sources) and not any(transport.exists(s.path) for s in sources):
            print(
                f"meshrun: no log yet at {sources[0].path}"
                + ("" if args.batch else " (try --batch for the job's own log)"),
                file=sys.stderr,
            )
    finally:
        clusters.close()
    return 0


def _print_diagnosis(transport: Any, record: Any) -> int:
    from submit.views import logs

    files = logs.fetch_diagnosis(transport, record.run_dir)
    text = logs.format_diagnosis(files, record.job_id, record.run_dir)
    if not files:
        print(f"meshrun: {text}", end="", file=sys.stderr)
        return 0
    sys.stdout.write(text)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from submit import api
    from submit.jobs.registry import Registry

    registry = Registry()
    records = registry.find_all(args.job, args.cluster)
    clusters = api.Clusters()
    try:
        api.cancel(records, clusters, registry)
    finally:
        clusters.close()
    what = f"job array {args.job} ({len(records)} tasks)" if len(records) > 1 else f"job {records[0].job_id}"
    print(f"cancelled {what} on {records[0].cluster}")
    return 0


def cmd_trust(args: argparse.Namespace) -> int:
    from submit.config.cluster import load_profile
    from submit.transport.trust import trust

    profile = load_profile(args.cluster)
    if profile.ssh is None:
        raise InputError("CLUSTER", args.cluster, "this profile has no `ssh:` section: there is no host to trust")
    trust(profile.ssh, args.cluster, args.fingerprint, args.replace)
    return 0
