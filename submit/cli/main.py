"""The `meshrun` command: clusters, render, submit, status, logs, cancel, tb, trust, data, watch, top.

Bad input exits 2 with one line on stderr naming the key, the value and the fix;
a cluster problem exits 1 with one line. Never a traceback for either.
Start-up stays fast and torch-free: heavy imports happen inside the verbs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Sequence

from meshrun.launcher.contract.exitcodes import EXIT_INPUT
from meshrun.launcher.contract.private import private_umask
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.submit.cli import checkpoints as cli_ckpt
from meshrun.submit.cli import doctor as cli_doctor
from meshrun.submit.cli import jobs as cli_jobs
from meshrun.submit.cli import live as cli_live
from meshrun.submit.cli import plan as cli_plan
from meshrun.submit.cli import tb as cli_tb
from meshrun.submit.cli.args import cluster_arg, overrides_arg, positive_int, spec_path
from meshrun.submit.cli.common import finish_wait, profile_path_of
from meshrun.submit.errors import ClusterError, FlagConflict, HostKeyError, InputError, InternalError, MeshrunError
from meshrun.submit.views import code as code_view
from meshrun.submit.views.tables import table


def _spec_args(parser: argparse.ArgumentParser, choose: bool = False) -> None:
    parser.add_argument("spec", type=spec_path, help="job spec YAML (see examples/)")
    cluster_arg(parser, choose)
    overrides_arg(parser, "override a spec key, e.g. --set train.steps=100 (repeatable)")
    parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a Slurm job array with one task per value (repeatable: every combination); each task reads its own spec",
    )


class _Version(argparse.Action):
    """--version, looked up only when asked (the package metadata costs every other verb's start-up)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: Optional[str] = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        from meshrun.submit import installed_version

        print(f"meshrun {installed_version()}")
        parser.exit()


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other meshrun error (not the usage block), naming
    where the whole usage is; every verb's parser is one of these (subparsers take their parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INPUT, f"{self.prog}: error: {message} (`{self.prog} --help` shows the usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="meshrun",
        description="Large-model training from a laptop to a multi-node GPU Slurm cluster, and kept alive there.",
    )
    parser.add_argument("--version", action=_Version, help="print meshrun's version and exit")
    verbs: argparse._SubParsersAction[argparse.ArgumentParser] = parser.add_subparsers(  # type: ignore[assignment]
        dest="verb", required=True, metavar="VERB"
    )  # the verbs' parsers are _OneLineErrors too (argparse makes them of the parent's class)

    verbs.add_parser("clusters", help="list the cluster profiles")

    p = verbs.add_parser("render", help="print the batch script for a job; touches nothing (unless --upload)")
    _spec_args(p)
    p.add_argument("-o", "--output", type=Path, help="write the script to this file")
    p.add_argument(
        "--offline",
        action="store_true",
        help="connect to nothing: the cluster's home stays ~ and the folder of the job's code is not looked up",
    )
    p.add_argument(
        "--upload",
        action="store_true",
        help="also put the job's code on the cluster (the sealed copy the script runs from): then sbatch it by hand",
    )

    p = verbs.add_parser("submit", help="validate, render and submit a job")
    _spec_args(p, choose=True)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="show exactly what would be sent (the script, the start command, the run-dir files); submit nothing",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: the request as JSON fields")
    p.add_argument("--wait", action="store_true", help="wait for the end; exit 0 only if it succeeded")
    p.add_argument("--force", action="store_true", help="submit even when the plan says it cannot fit the GPUs")
    check = p.add_mutually_exclusive_group()
    check.add_argument(
        "--check",
        action="store_true",
        help="only the preflight: ask the cluster whether the job would start (Slurm, files, environment, "
        "space), print each check and Slurm's start estimate; submit nothing (exit 2 if one fails)",
    )
    check.add_argument("--no-check", action="store_true", help="skip the preflight every submit runs (one round trip)")
    p.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="[KIND:]JOB",
        help="start only after JOB succeeded (KIND: ok, any, notok, start; repeatable)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="NODE[,NODE...]",
        help="never run on these nodes (added to the profile's defaults.exclude; `meshrun doctor` names bad ones)",
    )

    p = verbs.add_parser("status", help="the state of submitted jobs")
    p.add_argument("jobs", nargs="*", help="job ids, or a job array's id (default: the most recent jobs)")
    p.add_argument("--json", action="store_true", help="print a JSON list (one per refresh with --watch)")
    p.add_argument("--watch", action="store_true", help="refresh until every job is done (backing off)")
    p.add_argument("-n", "--limit", type=positive_int, default=20, help="how many recent jobs without ids")
    p.add_argument("-c", "--cluster", help="only this cluster")

    p = verbs.add_parser("logs", help="print (or follow) a job's logs")
    p.add_argument("job")
    p.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the job ends (survives a dropped connection)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--rank", default="0", help="this rank's log (default 0); 0,3 or all: merged, each line prefixed [rank N]"
    )
    which.add_argument("--batch", action="store_true", help="the batch shell's (or local supervisor's) log")
    which.add_argument(
        "--diagnosis", action="store_true", help="a hang's diagnosis: the verdict, every rank's stack, the heartbeats"
    )
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser("cancel", help="cancel a job (or a whole job array)")
    p.add_argument("job")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    cli_tb.add_parser(verbs)

    p = verbs.add_parser("trust", help="show a cluster's SSH host key fingerprint and record it on your word")
    p.add_argument("cluster", help="cluster profile name or YAML file")
    p.add_argument(
        "--fingerprint",
        action="append",
        help="record without asking if the key has this "
        "fingerprint (SHA256:...); repeat it for each jump host (matched to whichever hop shows it)",
    )
    p.add_argument(
        "--replace", action="store_true", help="replace a CHANGED key (only after the admins confirmed the change)"
    )

    cli_ckpt.add_parsers(verbs)
    cli_plan.add_parsers(verbs)
    cli_live.add_parsers(verbs)
    cli_doctor.add_parsers(verbs)

    p = verbs.add_parser(
        "data",
        help="build a token file from text on this machine (.txt/.md/.jsonl/source files; bytes, BPE or your tokenizer)",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUT",
        help="folders, files or globs of text (default: Python's standard library .py sources)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="token file to write (default: ~/.cache/meshrun/data/stdlib.u16, the data.path of a spec that names none)",
    )
    p.add_argument("--source", type=Path, action="append", default=[], help=argparse.SUPPRESS)  # older name of INPUT
    p.add_argument(
        "--tokenizer",
        default="bytes",
        help="bytes (default), bpe (trained here on the inputs, needs --vocab) or a tokenizer.json file",
    )
    p.add_argument("--vocab", type=int, default=None, help="the BPE's vocabulary size, e.g. 32000")
    p.add_argument("--eot", default=None, help="a tokenizer.json's end-of-text token (default: found by name)")
    p.add_argument("--field", default="text", help="the text field of .jsonl lines (default: text)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="documents held out for validation, written beside the token file (default 0.05; 0: none)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out choice (default 0)")
    p.add_argument(
        "--max-mb",
        type=float,
        default=None,
        help="read whole documents up to this many MB of text (default: all of the inputs; the default corpus: 16 MiB)",
    )
    return parser


# ------------------------------------------------------------------ verbs


def cmd_clusters(args: argparse.Namespace) -> int:
    from meshrun.submit.config.cluster import SHIPPED_DIR, load_profile_file, profile_files, user_dir

    def source(path: Path) -> str:  # where the profile `-c NAME` reads comes from (docs/concepts/cluster-profiles.md)
        folder = path.parent.resolve()
        if folder == SHIPPED_DIR.resolve():
            return "shipped"
        return "yours" if folder == user_dir().resolve() else "MESHRUN_CLUSTERS"

    rows = [("NAME", "SCHEDULER", "REACHED", "FROM", "PARTITIONS", "DESCRIPTION")]
    for name, path in sorted(profile_files().items()):
        try:
            prof = load_profile_file(path)
        except InputError as exc:
            rows.append((name, "-", "-", source(path), "-", f"INVALID: {exc}"))
            continue
        reach = f"ssh {prof.ssh.host}" if prof.ssh else "this machine"
        parts = ",".join(f"{p.name}({p.gpus_per_node}gpu)" for p in prof.partitions)
        rows.append((name, prof.scheduler, reach, source(path), parts, prof.description))
    _table(rows)
    return 0


def _plan(args: argparse.Namespace, profile: Any) -> Any:
    """Load, validate and resolve the job: every input error surfaces here, before any connection."""
    from meshrun.submit import api

    return api.plan_job(args.spec, profile, args.overrides, args.sweep)


def cmd_render(args: argparse.Namespace) -> int:
    """The script a submit would write, byte for byte (over SSH the login node is asked for its home);
    nothing is written on the cluster unless --upload asks for the sealed copy of the code the script runs from."""
    from meshrun.submit import api

    profile = api.load_cluster(args.cluster)
    plan = _plan(args, profile)  # every input error before any connection
    if args.offline:
        if args.upload:
            raise FlagConflict("--offline", "with --upload", "an upload connects to the cluster: drop one of them")
        print("# render --offline: the cluster was not asked (its home stays ~)", file=sys.stderr)
        _write_script(args.output, api.prepare(plan, args.spec.parent).request.script)
        return 0
    try:
        transport = api.connect(profile.ssh, args.cluster)
    except ClusterError as exc:
        if isinstance(exc, HostKeyError) or args.upload:
            raise
        # render asks the login node only for its home: an example profile's host need not exist
        raise ClusterError(f"{exc}; or render without asking the cluster: add --offline") from None
    try:
        prepared = api.prepare(plan, args.spec.parent, transport, read_only=not args.upload)
        _warn(prepared.warnings)
        if args.upload:
            uploaded = api.upload(prepared, transport)
            if uploaded is not prepared:
                print(code_view.uploaded(prepared.plan.code_dir), file=sys.stderr)
            prepared = uploaded
    finally:
        transport.close()
    _write_script(args.output, prepared.request.script)
    if prepared.found is not None and prepared.plan.code_dir is not None:
        output = ["-o", str(args.output)] if args.output else []
        again = ["meshrun", "render", str(args.spec), "-c", args.cluster, *output]
        print(code_view.needed(prepared.plan.code_dir, prepared.found.present, again), file=sys.stderr)
    return 0


def _warn(lines: Sequence[str]) -> None:
    for line in lines:  # once: when the code goes to a new copy
        print(f"meshrun: warning: {line}", file=sys.stderr)


def _check_submit_flags(args: argparse.Namespace, scheduler: str) -> None:
    from meshrun.submit import api

    api.check_dependencies(args.after, scheduler)
    if args.json and not args.dry_run:
        raise FlagConflict("--json", "without --dry-run", "--json prints the request of a --dry-run: add --dry-run")
    if args.check and (args.dry_run or args.wait):  # a sweep may be checked first: its array's test-only
        other = "--dry-run" if args.dry_run else "--wait"
        raise FlagConflict("--check", f"with {other}", "--check submits nothing: use one of them at a time")
    if args.sweep and args.wait:
        raise FlagConflict(
            "--wait", "with --sweep", "a sweep is several jobs: follow them with `meshrun status ID --watch`"
        )


def print_request(prepared: Any, as_json: bool) -> None:
    """`submit --dry-run`: the request exactly as it would be sent."""
    from meshrun.submit.planning.plan import describe

    plan, request = prepared.plan, prepared.request
    code = code_view.summary(prepared.code)
    if as_json:
        print(json.dumps({"dry_run": True, **describe(plan), "code": code, "request": request.as_json()}, indent=2))
        return
    summary = describe(plan)
    print("# meshrun submit --dry-run: nothing was sent", file=sys.stderr)
    print("plan: " + ", ".join(f"{k}={v}" for k, v in summary.items() if k != "tasks"))
    for task in summary.get("tasks", ()):
        print(f"  task {task['index']}: {task['overrides']}  {task['run_dir']}")
    if code:
        print(f"code: {code['files']} files, {code['bytes']:,} bytes from {code['root']} -> {request.code_dir}")
    print("start: " + shlex.join(request.argv))
    print("run-dir files:")
    for item in request.as_json()["files"]:
        print(f"  {item['mode']:>6}  {item['path']}")
    print(f"--- {request.script_path}")
    sys.stdout.write(request.script)


def _write_script(output: Optional[Path], script: str) -> None:
    """render's script: to -o's file, or stdout."""
    if output:
        write_output(output, script)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(script)


def write_output(path: Path, text: str) -> None:
    """-o PATH: the file, or one line naming the flag, the path and what to do (never an errno traceback)."""
    from meshrun.submit.jobs.checkpoints import check_output  # export's -o check: a file in a folder that exists

    path = check_output(path, example="job.sbatch")
    try:
        path.write_text(text)
    except OSError as exc:
        raise InputError("-o", str(path), f"cannot write it ({exc.strerror}): give a writable path") from None


def cmd_submit(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.jobs.doctor import with_exclude

    asked = api.clusters_asked(args.cluster)
    if asked is not None:
        return _submit_soonest(args, asked)
    profile = with_exclude(api.load_cluster(args.cluster), args.exclude, api.reaches_other_machines)
    _check_submit_flags(args, profile.scheduler)
    plan = _plan(args, profile)  # every input error surfaces before any connection
    api.check_job(plan, force=args.force)  # missing files seen from here; a job that cannot fit its GPUs
    if args.dry_run and api.is_local(profile) and not api.reaches_other_machines(profile.scheduler):
        if args.after:  # a login node's Slurm is asked here too (nothing is written by asking)
            transport = api.connect(profile.ssh, args.cluster)
            try:
                api.check_after(profile, args.after, transport)
            finally:
                transport.close()
        prepared = api.prepare(plan, args.spec.parent, after=args.after)
        print_request(prepared, args.json)
        return 0
    return _submit(args, profile, plan)


def _submit(args: argparse.Namespace, profile: Any, plan: Any) -> int:
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.views.progress import ProgressBar

    clusters = api.Clusters()
    try:
        try:
            transport = api.connect(profile.ssh, args.cluster)
        except ClusterError as exc:
            if not args.dry_run or isinstance(exc, HostKeyError):
                raise
            # A dry run asks the login node for its home and where the job's code lies; an example profile's host
            # need not exist: render shows the script without asking.
            offline = shlex.join(["meshrun", "render", str(args.spec), "-c", args.cluster, "--offline"])
            raise ClusterError(f"{exc}; or see the script without asking the cluster: {offline}") from None
        clusters.adopt(profile, transport, profile_path_of(args.cluster))
        # A dry run (on a login node too: it reads the suspect-node ledger as render does) writes nothing.
        read_only = args.check or args.dry_run
        prepared = api.prepare(plan, args.spec.parent, transport, after=args.after, read_only=read_only)
        _warn(prepared.warnings)
        if args.dry_run:
            print_request(prepared, args.json)
            return 0
        if not args.no_check:
            checked = api.preflight(prepared, transport)
            if args.check:
                return _print_preflight(prepared, checked)
            if checked.failures:
                raise PreflightFailed(checked)
        code = prepared.code
        bar = ProgressBar(f"uploading code ({len(code.files)} files)" if code else "")
        registry = Registry()
        records, uploaded = api.send(
            prepared, registry, transport, args.spec.parent, profile_path_of(args.cluster), progress=bar
        )
        for record in records if getattr(args, "chosen", None) else ():
            registry.set_chosen(record, args.chosen)
        if uploaded:
            bar.done()
        elif code is not None:
            print(code_view.unchanged(code, profile.name), file=sys.stderr)
        _print_submitted(prepared.plan, records)
        if not args.wait:
            return 0
        spec = prepared.plan.spec
        return finish_wait(records[0], clusters, registry, total_steps=None if spec.command else spec.trainer.steps)
    finally:
        clusters.close()


def _submit_soonest(args: argparse.Namespace, asked: list[str]) -> int:
    """`submit -c any` / `-c a,b`: ask each cluster (and partition) when the job would start, print the table
    that decides, and submit to the soonest (with --dry-run or --check: only the table)."""
    from meshrun.submit import api

    for flag, given in (("--sweep", args.sweep), ("--exclude", args.exclude), ("--after", args.after)):
        if given:
            raise InputError(
                flag, " ".join(given), f"name one cluster with -c to use {flag} (-c {args.cluster} chooses one)"
            )
    if args.no_check:
        raise InputError(
            "--no-check", args.cluster, "choosing a cluster asks each the preflight's questions: name one with -c"
        )
    found = api.candidates(args.spec, asked, args.overrides)
    rows = [["CLUSTER", "PARTITION", "STARTS", "STEP", "FINISH", "FREE", "WHY"]]
    rows += [[c.cluster, c.partition, c.start or "never", *_step_and_finish(c), _free(c), c.why] for c in found]
    choice = api.choose(found)
    print(table(rows), end="", file=sys.stderr)
    if choice is None:
        raise InputError("-c/--cluster", args.cluster, "no cluster asked can run the job (the table above says why)")
    chosen = choice.candidate
    names = ", ".join(f"{c.cluster}/{c.partition}" for c in found)
    # The rule that decided comes first: a tie on start is broken on finish, free nodes, then the order written.
    why = f"soonest of {len(found)} asked ({names}): {choice.rule}; {chosen.why}"
    print(f"# chose {chosen.cluster}, partition {chosen.partition}: {why}", file=sys.stderr)
    if args.dry_run or args.check:
        return 0
    args.cluster = chosen.given
    if chosen.partition != "-":
        args.overrides = [*args.overrides, f"resources.partition={chosen.partition}"]
    args.chosen = why
    return cmd_submit(args)


def _free(candidate: Any) -> str:
    """The FREE cell: the partition's idle nodes when asked ("?": not known, "-": not asked)."""
    if candidate.free_nodes is not None:
        return str(candidate.free_nodes)
    return "?" if candidate.ok else "-"


def _step_and_finish(candidate: Any) -> tuple[str, str]:
    """The STEP and FINISH cells of the `-c any` table: the planner's step time, and the start plus the steps
    at that pace ("+2h05m" after a start of "now"); "?" where the step time is unknown."""
    import datetime as dt

    from meshrun.submit.views.tables import span

    if candidate.step_s is None or candidate.run_s is None:
        return "?", "?"
    # a step is often well under a second: three figures (0.0436s), where span's one decimal would say 0.0s
    step = f"{candidate.step_s:.3g}s" if candidate.step_s < 10 else span(candidate.step_s)
    if candidate.start is None:
        return step, "-"
    if candidate.start == "now":
        return step, f"+{span(candidate.run_s)}"
    try:
        start = dt.datetime.fromisoformat(candidate.start)
    except ValueError:
        return step, f"start +{span(candidate.run_s)}"
    return step, (start + dt.timedelta(seconds=candidate.run_s)).isoformat(timespec="seconds")  # as STARTS


def _print_preflight(prepared: Any, checked: Any) -> int:
    """`submit --check`: each check, then where the code stands; exit 2 when one failed."""
    for line in checked.describe():
        print(line)
    if prepared.code is not None:
        print(code_view.checked(prepared.code, prepared.found))
    verdict = "would start" if not checked.failures else f"would fail: {len(checked.failures)} check(s) above"
    tasks = len(prepared.plan.tasks)
    what = f"the job array ({tasks} tasks)" if tasks else "the job"  # a sweep's checks are its first task's
    print(f"# meshrun submit --check: nothing was queued; {what} {verdict}", file=sys.stderr)
    return EXIT_INPUT if checked.failures else 0


class PreflightFailed(MeshrunError):
    """A submit whose preflight failed: nothing was queued. Each failed check is one line."""

    exit_code = EXIT_INPUT

    def __init__(self, checked: Any) -> None:
        lines = checked.failure_lines()
        super().__init__("\nmeshrun: error: ".join([*lines, "nothing was queued (`--no-check` skips these checks)"]))


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


def cmd_data(args: argparse.Namespace) -> int:
    """Runs `python -m meshrun.launcher.data.corpus`, which checks every option (one line, exit 2) and builds: the
    caller's side imports only launcher's torch-free contract."""
    import subprocess

    from meshrun.launcher.contract.spec.job import (
        DEFAULT_DATA_PATH,  # here: the spec module is not every verb's start-up cost
    )

    out = args.out if args.out is not None else Path(DEFAULT_DATA_PATH)
    if out.expanduser().is_dir():  # before anything is written (the build writes OUT.val beside OUT)
        raise InputError(
            "--out", str(out), f"is a folder: give the token file's name in it, e.g. --out {out / 'corpus.u16'}"
        )
    inputs = [*args.inputs, *(str(folder) for folder in args.source)]
    options = [
        ("--tokenizer", args.tokenizer),
        ("--vocab", args.vocab),
        ("--eot", args.eot),
        ("--field", args.field),
        ("--val-fraction", args.val_fraction),
        ("--seed", args.seed),
        ("--max-bytes", None if args.max_mb is None else int(args.max_mb * 1e6)),
    ]
    flags = [f"{flag}={value}" for flag, value in options if value is not None]
    # "--" ends the options: an input named like a flag is still a path.
    argv = [sys.executable, "-m", "meshrun.launcher.data.corpus", *flags, "--", str(out.expanduser()), *inputs]
    return subprocess.run(argv, check=False).returncode


# ------------------------------------------------------------------ helpers


def _table(rows: Sequence[Sequence[str]]) -> None:
    sys.stdout.write(table(rows))


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "clusters": cmd_clusters,
    "render": cmd_render,
    "submit": cmd_submit,
    "status": cli_jobs.cmd_status,
    "logs": cli_jobs.cmd_logs,
    "cancel": cli_jobs.cmd_cancel,
    "tb": cli_tb.cmd_tb,
    "trust": cli_jobs.cmd_trust,
    "data": cmd_data,
    "resume": cli_ckpt.cmd_resume,
    "export": cli_ckpt.cmd_export,
    "plan": cli_plan.cmd_plan,
    "watch": cli_live.cmd_watch,
    "top": cli_live.cmd_top,
    "doctor": cli_doctor.cmd_doctor,
    "nodes": cli_doctor.cmd_nodes,
}


def _suggest_a_verb(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A mistyped verb gets the nearest one, as a mistyped spec key does (argparse lists them all)."""
    from meshrun.launcher.contract.spec.schema import closest

    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    first = next((word for word in argv if not word.startswith("-")), None)
    if first is not None and first not in verbs and (hint := closest(first, verbs)):
        parser.error(f"no verb {first!r}{hint}")


def _named_as_given(exc: SchemaError, argv: Sequence[str]) -> SchemaError:
    """A cluster the user never typed came from $MESHRUN_CLUSTER (cluster_arg's default): the error names it."""
    typed = any(a in ("-c", "--cluster") or a.startswith(("-c", "--cluster=")) for a in argv)
    if exc.key == "-c/--cluster" and not typed and os.environ.get("MESHRUN_CLUSTER"):
        return SchemaError("$MESHRUN_CLUSTER", exc.value, exc.fix)
    return exc


def main(argv: Optional[Sequence[str]] = None) -> int:
    # Private whatever the user's umask: the registry, run dirs, uploads, sbatch (Slurm gives the job the
    # umask it was submitted with: output files, ranks) and the local supervisor inherit it.
    private_umask()
    parser = build_parser()
    _suggest_a_verb(parser, sys.argv[1:] if argv is None else list(argv))
    args = parser.parse_args(argv)
    try:
        return VERBS[args.verb](args)
    except SchemaError as exc:
        print(f"meshrun: error: {_named_as_given(exc, sys.argv[1:] if argv is None else list(argv))}", file=sys.stderr)
        return EXIT_INPUT
    except MeshrunError as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("meshrun: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        raise
    except BrokenPipeError:
        # The reader went away (`meshrun logs JOB | head -1`): what it did not read is not an error. stdout
        # points at /dev/null from here, or Python's flush at exit would report the same broken pipe again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # a bug in meshrun: one line, not a traceback (MESHRUN_DEBUG=1 shows it)
        if os.environ.get("MESHRUN_DEBUG"):
            raise
        print(
            f"meshrun: {InternalError(f'{type(exc).__name__}: {exc}')} (MESHRUN_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
