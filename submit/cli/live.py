"""The live verbs: `meshrun watch [JOB...] --notify CMD` and `meshrun top [JOB...]`."""

from __future__ import annotations

import argparse
from typing import Any


def add_parsers(verbs: Any) -> None:
    p = verbs.add_parser("watch", help="follow jobs until they end; print each new alert once and run --notify for it")
    p.add_argument("jobs", nargs="*", metavar="JOB", help="job ids (default: every running job of the registry)")
    p.add_argument(
        "--notify",
        metavar="CMD",
        help="run CMD (split into words, never by a shell) for each new alert, the alert as JSON on its stdin "
        "(default: `notify:` in ~/.config/meshrun/config.yaml)",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("-c", "--cluster", help="only this cluster")

    p = verbs.add_parser("top", help="one refreshing screen of every running job: step, loss, GPUs, alerts")
    p.add_argument("jobs", nargs="*", metavar="JOB", help="job ids (default: every running job of the registry)")
    p.add_argument("--once", action="store_true", help="print one refresh as plain lines and exit")
    p.add_argument("-c", "--cluster", help="only this cluster")


def _followed(args: argparse.Namespace, registry: Any) -> list[Any]:
    from meshrun.submit import api
    from meshrun.submit.views.watch import running_records

    api.check_cluster_filter(args.cluster, registry)
    if args.jobs:
        return [r for job in args.jobs for r in registry.find_all(job, args.cluster)]
    return [r for r in running_records(registry) if args.cluster in (None, r.cluster)]


def cmd_watch(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.config import userconfig
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.errors import InputError
    from meshrun.submit.views import watch

    if not args.interval > 0:
        raise InputError("--interval", args.interval, "give a positive number of seconds, e.g. 2")
    argv = watch.notify_argv(args.notify, userconfig.load().notify)
    registry = Registry()
    records = _followed(args, registry)
    if not records:
        print("meshrun: no running jobs to watch (`meshrun status` lists the recent ones)")
        return 0
    clusters = api.Clusters()
    try:
        return watch.follow(records, clusters, registry, argv, interval=args.interval)
    finally:
        clusters.close()


def cmd_top(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.views import top

    registry = Registry()
    records = _followed(args, registry)
    clusters = api.Clusters()
    try:
        return top.run(records, clusters, registry, once=args.once, named=bool(args.jobs))
    except KeyboardInterrupt:
        return 0
    finally:
        clusters.close()
