"""The `meshrun` command: clusters, render, submit, status, logs, cancel, data.

Bad input exits 2 with one line on stderr naming the key, the value and the fix;
a cluster problem exits 1 with one line. Never a traceback for either.
Start-up stays fast and torch-free: heavy imports happen inside the verbs.
"""
from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, TextIO

from launcher.schema import SchemaError
from submit.errors import EXIT_INPUT, InputError, MeshrunError

DEFAULT_CLUSTER = "local"


def _cluster_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--cluster", default=os.environ.get("MESHRUN_CLUSTER", DEFAULT_CLUSTER),
                        help="cluster profile name or YAML file (default: $MESHRUN_CLUSTER or local)")


def _spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, help="job spec YAML (see examples/)")
    _cluster_arg(parser)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec key, e.g. --set train.steps=100 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrun", description="Large-model training from a laptop to a "
                                     "multi-node GPU Slurm cluster, and kept alive there.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    verbs.add_parser("clusters", help="list the cluster profiles")

    p = verbs.add_parser("render", help="print the batch script for a job; touches nothing")
    _spec_args(p)
    p.add_argument("-o", "--output", type=Path, help="write the script to this file")

    p = verbs.add_parser("submit", help="validate, render and submit a job")
    _spec_args(p)
    p.add_argument("--dry-run", action="store_true", help="validate and render only; submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the end; exit 0 only if it succeeded")

    p = verbs.add_parser("status", help="the state of submitted jobs")
    p.add_argument("jobs", nargs="*", help="job ids (default: the most recent jobs)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.add_argument("-n", "--limit", type=int, default=20, help="how many recent jobs without ids")
    p.add_argument("-c", "--cluster", help="only this cluster")

    p = verbs.add_parser("logs", help="print (or follow) a job's logs")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, default=0, help="this rank's log (default 0)")
    which.add_argument("--batch", action="store_true", help="the batch shell's (or local supervisor's) log")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser("cancel", help="cancel a job")
    p.add_argument("job")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser("data", help="build the byte-level token corpus from text on this machine")
    p.add_argument("--out", type=Path, default=Path("~/.cache/meshrun/data/stdlib.u16").expanduser(),
                   help="token file to write (default: ~/.cache/meshrun/data/stdlib.u16)")
    p.add_argument("--source", type=Path, action="append", help="folder of text to read (default: Python's "
                   "standard library sources); repeatable")
    p.add_argument("--max-mb", type=float, default=16.0, help="at most this many MB of text (default 16)")
    return parser


# ------------------------------------------------------------------ verbs

def cmd_clusters(args: argparse.Namespace) -> int:
    from submit.cluster import load_profile_file, profile_files

    rows = [("NAME", "SCHEDULER", "REACHED", "PARTITIONS", "DESCRIPTION")]
    for name, path in sorted(profile_files().items()):
        try:
            prof = load_profile_file(path)
        except InputError as exc:
            rows.append((name, "-", "-", "-", f"INVALID: {exc}"))
            continue
        reach = f"ssh {prof.ssh.host}" if prof.ssh else "this machine"
        parts = ",".join(f"{p.name}({p.gpus_per_node}gpu)" for p in prof.partitions)
        rows.append((name, prof.scheduler, reach, parts, prof.description))
    _table(rows)
    return 0


def _plan(args: argparse.Namespace, home: Optional[str] = None, profile: Any = None) -> Any:
    from submit.cluster import load_profile
    from submit.plan import plan_file

    profile = profile or load_profile(args.cluster)
    if home is None:
        # Rendering touches no cluster: an SSH cluster's `~` is shown as its user's usual home.
        home = os.path.expanduser("~") if profile.ssh is None else f"/home/{profile.ssh.user or getpass.getuser()}"
    return plan_file(args.spec, profile, args.overrides, home=home)


def cmd_render(args: argparse.Namespace) -> int:
    from submit.render import render

    text = render(_plan(args))
    if args.output:
        args.output.write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from submit import api
    from submit.plan import describe
    from submit.registry import Registry
    from submit.render import render

    if args.dry_run:
        plan = _plan(args)
        render(plan)
        print(json.dumps({"dry_run": True, **describe(plan)}, indent=2))
        return 0
    from submit.cluster import load_profile
    from submit.transport import connect

    profile = load_profile(args.cluster)
    plan = _plan(args, profile=profile)  # every input error surfaces before any connection
    clusters = api.Clusters()
    try:
        transport = connect(profile.ssh)
        clusters.adopt(profile, transport)
        if profile.ssh is not None:
            plan = _plan(args, home=transport.home(), profile=profile)
        registry = Registry()
        record = api.submit(plan, registry, transport, spec_dir=args.spec.parent)
        print(f"submitted job {record.job_id} on {record.cluster}")
        print(f"run dir: {record.run_dir}")
        if not args.wait:
            return 0
        status = wait_for(record, clusters, registry, total_steps=None if plan.spec.command else plan.spec.trainer.steps)
        print(f"job {record.job_id} {status.state}" + (f" ({status.reason})" if status.reason else ""))
        print(f"logs: {record.run_dir}/logs   metrics: {record.run_dir}/{api.METRICS_FILE}")
        return 0 if status.succeeded else 1
    finally:
        clusters.close()


def _poll_interval(elapsed: float, scheduler: str) -> float:
    """Back off so a long wait does not hammer slurmctld: 2 s, then 5 s, then 10 s."""
    if scheduler == "local":
        return 0.5
    return 2.0 if elapsed < 30 else 5.0 if elapsed < 300 else 10.0


def progress_line(status: Any, total_steps: Optional[int]) -> str:
    parts = [f"[{status.state}]"]
    step = status.progress.get("step")
    if step is not None:
        parts.append(f"step {step}/{total_steps}" if total_steps else f"step {step}")
    if "loss" in status.progress:
        parts.append(f"loss {status.progress['loss']:.4f}")
    if status.elapsed_s is not None:
        parts.append(f"elapsed {_clock(status.elapsed_s)}")
        if status.time_limit_s:
            parts.append(f"left {_clock(max(status.time_limit_s - status.elapsed_s, 0))}")
    if status.reason and not status.done:
        parts.append(f"({status.reason})")
    return " ".join(parts)


def wait_for(record: Any, clusters: Any, registry: Any, total_steps: Optional[int],
             out: TextIO = sys.stderr) -> Any:
    """Poll until the job ends, showing progress (one rewritten line on a terminal, plain lines piped)."""
    from submit import api

    tty, last, started = out.isatty(), None, time.monotonic()
    while True:
        status = api.statuses([record], clusters, registry)[0]
        line = progress_line(status, total_steps)
        # Piped output gets a line only when the state or the step changes, not every tick.
        changed = (status.state, status.progress.get("step")) != last
        if tty:
            out.write("\r\x1b[2K" + line)
        elif changed:
            out.write(line + "\n")
        out.flush()
        last = (status.state, status.progress.get("step"))
        if status.done:
            if tty:
                out.write("\n")
            return status
        time.sleep(_poll_interval(time.monotonic() - started, record.scheduler))


def cmd_status(args: argparse.Namespace) -> int:
    from submit import api
    from submit.registry import Registry

    registry = Registry()
    records = ([registry.find(j, args.cluster) for j in args.jobs] if args.jobs
               else registry.recent(args.limit, args.cluster))
    clusters = api.Clusters()
    try:
        found = api.statuses(records, clusters, registry)
    finally:
        clusters.close()
    if args.json:
        print(json.dumps([s.as_json() for s in found], indent=2))
        return 0
    rows = [("JOB", "CLUSTER", "NAME", "STATE", "STEP", "LOSS", "ELAPSED", "RUN DIR")]
    for s in found:
        loss = s.progress.get("loss")
        rows.append((s.job_id, s.cluster, s.name, s.state, str(s.progress.get("step", "-")),
                     f"{loss:.4f}" if isinstance(loss, (int, float)) else "-",
                     _clock(s.elapsed_s) if s.elapsed_s is not None else "-", s.run_dir))
    _table(rows)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from submit import api
    from submit.registry import Registry

    registry = Registry()
    record = registry.find(args.job, args.cluster)
    path = api.log_path(record, None if args.batch else args.rank)
    clusters = api.Clusters()
    try:
        transport = clusters.transport(record.cluster)
        offset = _copy_new(transport, path, 0)
        while args.follow:
            done = api.statuses([record], clusters)[0].done
            offset = _copy_new(transport, path, offset)
            if done:
                break
            time.sleep(0.5)
        if offset == 0 and not transport.exists(path):
            print(f"meshrun: no log yet at {path}" + ("" if args.batch else " (try --batch for the job's own log)"),
                  file=sys.stderr)
    finally:
        clusters.close()
    return 0


def _copy_new(transport: Any, path: str, offset: int) -> int:
    """Print what the file gained since `offset`; returns the new offset (byte-exact, no line lost)."""
    while True:
        chunk = transport.read_bytes(path, offset, 1 << 20)
        if not chunk:
            return offset
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        offset += len(chunk)


def cmd_cancel(args: argparse.Namespace) -> int:
    from submit import api
    from submit.registry import Registry

    record = Registry().find(args.job, args.cluster)
    clusters = api.Clusters()
    try:
        api.cancel(record, clusters)
    finally:
        clusters.close()
    print(f"cancelled job {record.job_id} on {record.cluster}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from launcher.corpus import build_corpus

    if args.max_mb <= 0:
        raise InputError("--max-mb", args.max_mb, "give a positive size, e.g. 16")
    for folder in args.source or ():
        if not folder.is_dir():
            raise InputError("--source", str(folder), "not a folder; give a folder of text files")
    stats = build_corpus(args.out.expanduser(), roots=args.source, max_bytes=int(args.max_mb * 1e6))
    print(f"wrote {args.out} ({stats.tokens:,} tokens from {stats.sources:,} files)")
    return 0


# ------------------------------------------------------------------ helpers

def _clock(seconds: Optional[int]) -> str:
    seconds = int(seconds or 0)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "clusters": cmd_clusters, "render": cmd_render, "submit": cmd_submit, "status": cmd_status,
    "logs": cmd_logs, "cancel": cmd_cancel, "data": cmd_data,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return VERBS[args.verb](args)
    except SchemaError as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except MeshrunError as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("meshrun: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
