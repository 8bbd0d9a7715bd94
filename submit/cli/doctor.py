"""`meshrun doctor -c CLUSTER [--nodes N] [--partition P]`: a short preflight job through the normal
submission path (plan -> dryrun -> schedule -> record), waited for, then one pass/warn/fail row per node."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from meshrun.submit.cli.args import cluster_arg
from meshrun.submit.errors import InputError

FLAG_FOR_KEY = {
    "resources.nodes": "--nodes",
    "resources.partition": "--partition",
    "resources.gpus_per_node": "--gpus-per-node",
    "resources.cpus_per_task": "--gpus-per-node",
    "resources.time": "--time",
}
"""The planner names spec keys; doctor's user typed flags: an error names the flag."""


def add_parsers(verbs: Any) -> None:
    p = verbs.add_parser("doctor", help="a short preflight job: versions, GPUs, all-reduce, GEMM, storage per node")
    cluster_arg(p)
    p.add_argument("--nodes", type=int, help="nodes to check (default: 2 where the cluster has several, else 1)")
    p.add_argument("--partition", help="partition to check (default: the profile's default partition)")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs to ask per node (default: the partition's; 0 runs the CPU subset: 2 gloo ranks per node)",
    )
    p.add_argument("--data", help="a data file to read, as the nodes see it (absolute path)")
    p.add_argument("--storage-mib", type=int, default=None, help="MiB written per storage check (default 64, CPU 8)")
    p.add_argument("--time", default="00:10:00", help="the job's time limit (default 00:10:00)")
    p.add_argument("--json", action="store_true", help="print every rank's raw results as JSON instead of the table")

    p = verbs.add_parser(
        "nodes",
        help="the cluster's suspect nodes (a hang verdict blamed them; new submits leave them out); --clear trusts one again",
    )
    cluster_arg(p)
    # nargs="?": a bare --clear gets meshrun's own error (which node; --clear-all), not argparse's usage line.
    p.add_argument(
        "--clear", action="append", nargs="?", default=[], metavar="NODE", help="trust this node again (repeatable)"
    )
    p.add_argument("--clear-all", action="store_true", help="trust every suspect node of the cluster again")
    p.add_argument("--json", action="store_true", help="the suspects as JSON")


def options(args: argparse.Namespace, profile: Any) -> Any:
    """The doctor's options, checked: every input error before any connection."""
    from meshrun.submit import api
    from meshrun.submit.jobs.doctor import Options

    try:
        part = profile.partition(args.partition)
    except InputError as exc:
        raise InputError("--partition", exc.value, exc.fix) from None
    # A cluster that is not this machine has several nodes (the local one is this machine: one node).
    several = api.reaches_other_machines(profile.scheduler) and (part.max_nodes or 2) >= 2
    nodes = args.nodes if args.nodes is not None else (2 if several else 1)
    if nodes < 1:
        raise InputError("--nodes", nodes, "check at least 1 node")
    gpus = part.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node
    if gpus < 0:
        raise InputError("--gpus-per-node", gpus, "give 0 (the CPU subset) or more")
    if args.data is not None and not args.data.startswith("/"):
        raise InputError("--data", args.data, "give an absolute path as the nodes see it")
    mib = args.storage_mib if args.storage_mib is not None else (64 if gpus else 8)
    if mib < 1:
        raise InputError("--storage-mib", mib, "write at least 1 MiB, e.g. 64")
    return Options(nodes=nodes, partition=part, gpus_per_node=gpus, data=args.data, storage_mib=mib, time=args.time)


def doctor_plan(profile: Any, opts: Any, home: str) -> Any:
    from meshrun.launcher.contract.spec import schema
    from meshrun.launcher.contract.spec.job import JobSpec
    from meshrun.submit import api
    from meshrun.submit.jobs.doctor import job_spec

    data = job_spec(profile, opts)
    try:
        return api.plan_spec(schema.load(JobSpec, data), data, profile, home=home)
    except InputError as exc:
        flag = FLAG_FOR_KEY.get(exc.key)
        if flag is None:
            raise
        raise InputError(flag, exc.value, exc.fix) from None


def read_results(transport: Any, run_dir: str, world: int) -> list[Optional[dict[str, Any]]]:
    """Every rank's results file (None where a rank wrote none, or half of one)."""
    from meshrun.launcher.contract.records.rundir import RunDir

    out: list[Optional[dict[str, Any]]] = []
    for rank in range(world):
        raw = transport.read_bytes(RunDir(run_dir).doctor_result(rank))
        try:
            found = json.loads(raw) if raw else None
        except ValueError:
            found = None
        out.append(found if isinstance(found, dict) else None)
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    from meshrun.submit import api, installed_version
    from meshrun.submit.cli.common import profile_path_of, wait_for
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.jobs.doctor import judge, table

    profile = api.load_cluster(args.cluster)
    opts = options(args, profile)
    plan = doctor_plan(profile, opts, api.home_for(profile))  # every input error before any connection
    clusters = api.Clusters()
    try:
        transport = api.connect(profile.ssh, args.cluster)
        clusters.adopt(profile, transport, profile_path_of(args.cluster))
        plan = api.resolve_home(plan, transport)
        registry = Registry()
        (record,) = api.schedule(
            api.dryrun(plan), plan, registry, transport, profile_path=profile_path_of(args.cluster)
        )
        print(  # stderr with --json: stdout is the JSON document alone
            f"doctor: job {record.job_id} on {profile.name} ({opts.nodes} node{'s' if opts.nodes > 1 else ''}), run dir {plan.run_dir}",
            file=sys.stderr if args.json else sys.stdout,
        )
        try:
            status = wait_for(record, clusters, registry, None)
        except KeyboardInterrupt:
            print(f"\nmeshrun: stopped waiting; `meshrun cancel {record.job_id}` stops the doctor job", file=sys.stderr)
            return 130
        results = read_results(clusters.transport_for(record), plan.run_dir, plan.spec.world_size)
    finally:
        clusters.close()
    if args.json:
        print(json.dumps({"job": record.job_id, "state": status.state, "ranks": results}, indent=1))
        if status.succeeded and all(results):
            _calibrate(profile, opts, record.job_id, results, sys.stderr)
        return 0 if all(results) else 1
    report = judge(results, opts, profile, installed_version())
    sys.stdout.write(table(report))
    if not status.succeeded:
        print(f"doctor job {record.job_id} {status.state}: `meshrun logs {record.job_id} --rank all` shows why")
    elif not report.bad_nodes and all(results):
        _calibrate(profile, opts, record.job_id, results, sys.stdout)
    return 1 if report.bad_nodes or not status.succeeded else 0


def _calibrate(profile: Any, opts: Any, job: str, results: list[Any], out: Any) -> None:
    """Keep a healthy run's figures for `meshrun plan` (submit/planning/calibration.py), and say so."""
    from meshrun.submit.planning import calibration

    measured = calibration.from_results(results, job, opts.nodes)
    if measured is None:
        return
    path = calibration.save(profile.name, opts.partition.name, measured)
    what = "CPU" if measured.kind == "cpu" else "GPU"
    print(
        f"calibration: the {what} figures of partition {opts.partition.name} recorded in {path}; "
        f"`meshrun plan -c {profile.name}` times jobs with them",
        file=out,
    )


def cmd_nodes(args: argparse.Namespace) -> int:
    """`meshrun nodes -c CLUSTER [--clear NODE]`: the ledger of suspect nodes kept where the jobs run."""
    import time

    from meshrun.launcher.contract.nodelist import compress
    from meshrun.launcher.contract.records import suspects
    from meshrun.submit import api
    from meshrun.submit.views.tables import table

    if None in args.clear:
        raise InputError(
            "--clear",
            "",
            f"name the node to trust again (`meshrun nodes -c {args.cluster}` lists them), or --clear-all",
        )
    profile = api.load_cluster(args.cluster)
    if not api.reaches_other_machines(profile.scheduler):
        raise InputError(
            "-c/--cluster", args.cluster, "this cluster is this one machine, with no nodes to suspect: give -c CLUSTER"
        )
    transport = api.connect(profile.ssh, args.cluster)
    try:
        if args.clear_all:
            args.clear = [*args.clear, *api.suspect_nodes(profile, transport)]  # none: the listing says so
        if args.clear:
            cleared = api.clear_suspects(profile, transport, args.clear)
            if cleared:
                them = "it" if len(cleared) == 1 else "them"
                print(f"cleared {compress(cleared)}: new submits to {args.cluster} may use {them} again")
            for node in (n for n in dict.fromkeys(args.clear) if n not in cleared):
                print(f"{node} is not a suspect on {args.cluster}: nothing to clear")
        found = api.suspect_nodes(profile, transport)
    finally:
        transport.close()
    if args.json:
        print(json.dumps([vars(f) for f in found.values()], indent=1))
        return 0
    if not found:
        print(f"no suspect nodes on {args.cluster}")
        return 0
    now = time.time()
    rows = [(f.node, suspects.ago(now - f.time), f.job, f.evidence) for f in found.values()]
    print(table([("NODE", "SEEN", "JOB", "EVIDENCE"), *rows]))
    print(
        f"new submits leave these out (as far as the partition can spare); `meshrun nodes -c {args.cluster} --clear NODE`"
    )
    return 0
