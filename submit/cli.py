"""The `meshrun` command: clusters, render, submit, status, logs, cancel, tb, trust, data.

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
from submit import cli_ckpt, cli_jobs
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
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a Slurm job array with one task per value (repeatable: every combination); "
                             "each task reads its own spec")


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
    p.add_argument("--after", action="append", default=[], metavar="[KIND:]JOB",
                   help="start only after JOB succeeded (KIND: ok, any, notok, start; repeatable)")

    p = verbs.add_parser("status", help="the state of submitted jobs")
    p.add_argument("jobs", nargs="*", help="job ids, or a job array's id (default: the most recent jobs)")
    p.add_argument("--json", action="store_true", help="print a JSON list (one per refresh with --watch)")
    p.add_argument("--watch", action="store_true", help="refresh until every job is done (backing off)")
    p.add_argument("-n", "--limit", type=int, default=20, help="how many recent jobs without ids")
    p.add_argument("-c", "--cluster", help="only this cluster")

    p = verbs.add_parser("logs", help="print (or follow) a job's logs")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends (survives a "
                   "dropped connection)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--rank", default="0", help="this rank's log (default 0); 0,3 or all: merged, each line "
                       "prefixed [rank N]")
    which.add_argument("--batch", action="store_true", help="the batch shell's (or local supervisor's) log")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser("cancel", help="cancel a job (or a whole job array)")
    p.add_argument("job")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser("tb", help="TensorBoard of a job, on the login node, forwarded here; Ctrl-C stops it")
    p.add_argument("job")
    p.add_argument("--port", type=int, default=0, help="local port (default: any free one)")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser("trust", help="show a cluster's SSH host key fingerprint and record it on your word")
    p.add_argument("cluster", help="cluster profile name or YAML file")
    p.add_argument("--fingerprint", help="record without asking if the key has this fingerprint (SHA256:...)")
    p.add_argument("--replace", action="store_true", help="replace a CHANGED key (only after the admins "
                   "confirmed the change)")

    cli_ckpt.add_parsers(verbs)

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
    if args.sweep:
        from submit.sweep import plan_sweep

        if profile.scheduler != "slurm":
            raise InputError("--sweep", args.sweep[0], "sweeps run as Slurm job arrays; the local cluster runs "
                                                       "one job at a time")
        return plan_sweep(args.spec, profile, args.overrides, args.sweep, home=home)
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


def _profile_path(cluster: str) -> Optional[str]:
    """The profile file's absolute path when -c named a file (the registry keeps it for later verbs)."""
    from submit.cluster import is_profile_path

    return str(Path(cluster).resolve()) if is_profile_path(cluster) else None


def _check_submit_flags(args: argparse.Namespace, scheduler: str) -> None:
    from submit.slurm import dependency

    dependency(args.after)
    if scheduler != "slurm" and args.after:
        raise InputError("--after", args.after[0], "dependencies are Slurm's; the local cluster has none")
    if args.sweep and args.wait:
        raise InputError("--wait", "--sweep", "a sweep is several jobs: follow them with `meshrun status ID --watch`")


def cmd_submit(args: argparse.Namespace) -> int:
    from submit import snapshot
    from submit.cluster import load_profile
    from submit.plan import describe
    from submit.render import render

    profile = load_profile(args.cluster)
    _check_submit_flags(args, profile.scheduler)
    plan = _plan(args, profile=profile)  # every input error surfaces before any connection
    render(plan)
    snap = snapshot.collect(args.spec.parent, plan.spec.code) if profile.scheduler == "slurm" else None
    if args.dry_run:
        code = {"root": str(snap.root), "files": len(snap.files), "bytes": snap.size, "digest": snap.digest} \
            if snap else None
        print(json.dumps({"dry_run": True, **describe(plan), "code": code}, indent=2))
        return 0
    return _submit(args, profile, plan, snap)


def _submit(args: argparse.Namespace, profile: Any, plan: Any, snap: Any) -> int:
    from submit import api, snapshot
    from submit.progress import ProgressBar
    from submit.registry import Registry
    from submit.transport import connect

    clusters = api.Clusters()
    try:
        transport = connect(profile.ssh, args.cluster)
        clusters.adopt(profile, transport, _profile_path(args.cluster))
        present = None
        if profile.ssh is not None:  # the remote home (for `~`) and the snapshot's presence: one round trip
            home, present = snapshot.probe(transport, profile.paths.work_dir, snap)
            plan = _plan(args, home=home, profile=profile)
        bar = ProgressBar(f"uploading code ({len(snap.files)} files)" if snap else "")
        plan, uploaded = api.sync_code(plan, transport, snap, progress=bar, present=present)
        if uploaded:
            bar.done()
        elif snap is not None:
            print(f"code: unchanged, snapshot {snap.digest} already on {profile.name}", file=sys.stderr)
        registry = Registry()
        records = api.submit(plan, registry, transport, spec_dir=args.spec.parent, after=args.after,
                             profile_path=_profile_path(args.cluster))
        _print_submitted(plan, records)
        if not args.wait:
            return 0
        record = records[0]
        status = wait_for(record, clusters, registry, total_steps=None if plan.spec.command else plan.spec.trainer.steps)
        print(f"job {record.job_id} {status.state}" + (f" ({status.reason})" if status.reason else ""))
        print(f"logs: {record.run_dir}/logs   metrics: {record.run_dir}/{api.METRICS_FILE}")
        return 0 if status.succeeded else 1
    finally:
        clusters.close()


def _print_submitted(plan: Any, records: Sequence[Any]) -> None:
    if not plan.tasks:
        print(f"submitted job {records[0].job_id} on {records[0].cluster}")
    else:
        print(f"submitted job array {records[0].job_id.split('_')[0]} ({len(records)} tasks) on {records[0].cluster}")
        for task, record in zip(plan.tasks, records):
            print(f"  {record.job_id}  {task.label}")
    print(f"run dir: {plan.run_dir}")
    if plan.code_dir:
        print(f"code: {plan.code_dir}")


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

    from submit.transport import ConnectionLost

    tty, last, started = out.isatty(), None, time.monotonic()
    while True:
        try:
            status = api.statuses([record], clusters, registry)[0]
        except ConnectionLost:
            clusters.close()  # the job runs on regardless: reconnect at the next poll
            time.sleep(_poll_interval(time.monotonic() - started, record.scheduler))
            continue
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
    sys.stdout.write(cli_jobs.table(rows))


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "clusters": cmd_clusters, "render": cmd_render, "submit": cmd_submit, "status": cli_jobs.cmd_status,
    "logs": cli_jobs.cmd_logs, "cancel": cli_jobs.cmd_cancel, "tb": cli_jobs.cmd_tb, "trust": cli_jobs.cmd_trust,
    "data": cmd_data, "resume": cli_ckpt.cmd_resume, "export": cli_ckpt.cmd_export,
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
