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

from meshrun.submit.errors import InputError
from meshrun.submit.views.tables import detail_lines, status_table

WATCH_FIRST_S, WATCH_MAX_S = 2.0, 30.0


def _records(args: argparse.Namespace, registry: Any) -> list[Any]:
    if not args.jobs:
        recent: list[Any] = registry.recent(args.limit, args.cluster)
        return recent
    return [r for job in args.jobs for r in registry.find_all(job, args.cluster)]


def cmd_status(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry

    registry = Registry()
    if not args.jobs:
        api.check_cluster_filter(args.cluster, registry)
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
    from meshrun.submit.errors import ClusterError, InputError
    from meshrun.submit.jobs.checkpoints import best_checkpoint, checkpoint_dir

    try:
        transport = clusters.transport_for(record)
        return best_checkpoint(transport, checkpoint_dir(record, transport))
    except (ClusterError, InputError, OSError):
        return None  # the detail view shows what it has; `meshrun export --best` says why


def watch(records: Sequence[Any], clusters: Any, registry: Any, as_json: bool) -> int:
    """Refresh until every job is done: one round trip per cluster each time, backing off
    (2 s, growing to 30 s) while nothing changes; a terminal is redrawn, a pipe gets changes only."""

    from meshrun.submit.core.state import JobState
    from meshrun.submit.views.watch import refresh, watch_end

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
        if all(s.done or s.state == JobState.UNREACHABLE for s in found):
            return watch_end(found)
        time.sleep(interval)


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
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.views import logs

    record = _one_job(Registry(), args.job, args.cluster)
    clusters = api.Clusters()
    try:
        transport = clusters.transport_for(record)
        if getattr(args, "diagnosis", False):
            return _print_diagnosis(transport, record)
        sources = logs.sources_for(clusters, record, args.rank, args.batch, sys.stderr, args.follow)
        printer = logs.Printer(sys.stdout.buffer, merged=len(sources) > 1)
        if args.follow:
            logs.Follower(record, clusters, sources, printer, sys.stderr).run()
        else:
            logs.print_once(transport, sources, printer)
        transport = clusters.transport_for(record)  # after a reconnect, the new connection
        if all(s.offset == 0 for s in sources) and not any(transport.exists(s.path) for s in sources):
            if not transport.exists(record.run_dir):
                # Not "no log yet": the folder the logs live in is gone, so none will ever appear.
                print(
                    f"meshrun: the run dir of job {record.job_id} is gone ({record.run_dir}); no logs to show",
                    file=sys.stderr,
                )
                return 1
            reason = _ranks_reason(transport, record.run_dir) if not args.batch else ""
            if reason:
                # Its ranks wrote nothing and never will: say why (what the job recorded), not "no log yet".
                print(
                    f"meshrun: job {record.job_id} has no rank log: {reason} (`meshrun logs {record.job_id} --batch`"
                    " shows the job's own log)",
                    file=sys.stderr,
                )
                return 1
            print(
                f"meshrun: no log yet at {sources[0].path}"
                + ("" if args.batch else " (try --batch for the job's own log)"),
                file=sys.stderr,
            )
    finally:
        clusters.close()
    return 0


def _ranks_reason(transport: Any, run_dir: str) -> str:
    """The first line of the job's recorded reason (RUN_DIR/rank-error.txt: a rank's, or the batch script's when
    the ranks never started), "" when there is none."""
    from meshrun.launcher.contract.records.rundir import RunDir
    from meshrun.submit.textwidth import printable

    path = RunDir(run_dir).rank_error
    if not transport.exists(path):
        return ""
    lines = transport.read_bytes(path, limit=2000).decode(errors="replace").strip().splitlines()
    return printable(lines[0]) if lines else ""


def _print_diagnosis(transport: Any, record: Any) -> int:
    from meshrun.submit.views import logs

    files = logs.fetch_diagnosis(transport, record.run_dir)
    text = logs.format_diagnosis(files, record.job_id, record.run_dir)
    if not files:
        print(f"meshrun: {text}", end="", file=sys.stderr)
        return 0
    sys.stdout.write(text)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry

    registry = Registry()
    records = registry.find_all(args.job, args.cluster)
    clusters = api.Clusters()
    try:
        api.cancel(records, clusters, registry)
    finally:
        clusters.close()
    what = f"job array {args.job} ({len(records)} tasks)" if len(records) > 1 else f"job {records[0].job_id}"
    print(f"cancelled {what} on {records[0].cluster}", flush=True)  # before the stderr hint, in a merged stream
    # A cancel is a request: the ranks checkpoint and stop in their own time, so "cancelled" is not "ended".
    print(
        f"meshrun: its ranks save and stop first; `meshrun status {args.job}` says when it has ended", file=sys.stderr
    )
    return 0


def cmd_trust(args: argparse.Namespace) -> int:
    from meshrun.submit import api

    api.trust(api.load_cluster(args.cluster), args.cluster, args.fingerprint, args.replace)
    return 0
