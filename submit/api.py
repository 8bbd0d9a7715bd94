"""The Python face of meshrun, and the only module that both plans and talks to a cluster: the one road
every verb takes, from the CLI (which parses, calls this, prints) and from a Python caller alike.

submit = `plan_job` (pure, all input errors here) -> `check_job` (files and fit, before any
connection) -> `prepare` (one round trip: the cluster's home and which copy of the code snapshot the
job runs from; the backend builds the request: script, argv, run-dir files, each rendered once) ->
`send` (the code snapshot if it is not there yet, then exactly that request) -> record. A cluster
is this machine or reached over SSH by one test, `is_local(profile)`. status/logs/cancel/tb/resume read the registry, then reach the
job's cluster through `Clusters` (one connection per cluster for the whole command) and
its scheduler backend. `executor(...)` is the submitit API on a login node.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from meshrun.launcher.contract.private import private_umask_while
from meshrun.launcher.contract.records.suspects import LEDGER, Finding, suspects
from meshrun.launcher.contract.records.suspects import parse as parse_suspects
from meshrun.submit.config.cluster import (
    ClusterProfile,
    check_node_names,
    is_profile_path,
    load_profile,
    load_profile_file,
    profile_path,
)
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.jobs import suspects as job_suspects
from meshrun.submit.planning.soonest import Candidate, Choice, choose, soonest, wait_seconds
from meshrun.submit.schedulers import backend, check_profile
from meshrun.submit.schedulers.base import Request
from meshrun.submit.transport import connect
from meshrun.submit.transport.base import Progress, Transport, batch

if TYPE_CHECKING:
    from meshrun.launcher.contract.spec.job import JobSpec, RunSpec
    from meshrun.submit.core import status as job_status
    from meshrun.submit.core.plan import Plan
    from meshrun.submit.core.registry import JobRecord, Registry
    from meshrun.submit.core.status import METRICS_FILE, Status, last_metrics
    from meshrun.submit.schedulers.preflight import Preflight
    from meshrun.submit.transport import snapshot as snapshots

# Served by the module's __getattr__, imported when first asked for: `executor` (with submitit), and the
# status module's names (`render` and `submit` read no status: with the Slurm backend's, ~3.5 ms of their start-up).
_LAZY = {
    "executor": "meshrun.submit.executor",
    "METRICS_FILE": "meshrun.submit.core.status",
    "Status": "meshrun.submit.core.status",
    "last_metrics": "meshrun.submit.core.status",
}
__all__ = [
    "Candidate",
    "Choice",
    "choose",
    "soonest",
    "Clusters",
    "Prepared",
    "check_after",
    "check_dependencies",
    "check_job",
    "connect",
    "home_for",
    "interpreter",
    "is_local",
    "load_cluster",
    "plan_job",
    "plan_spec",
    "poll_interval",
    "prepare",
    "reaches_other_machines",
    "resolve_home",
    "resume",
    "send",
    "trust",
    "METRICS_FILE",  # noqa: F822
    "Request",
    "Status",  # noqa: F822
    "cancel",
    "dryrun",
    "executor",  # noqa: F822
    "git_sha",
    "last_metrics",  # noqa: F822
    "log_path",
    "schedule",
    "statuses",
    "submit",
    "sync_code",
    "with_code_dir",
]


def __getattr__(name: str) -> Any:
    """`from meshrun.submit.api import executor` (the submitit API), `Status`, ...: _LAZY's names, imported when asked for."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def git_sha(cwd: Path) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def with_code_dir(
    plan: Plan, snap: Optional[snapshots.Snapshot], in_place: Optional[str] = None, name: Optional[str] = None
) -> Plan:
    """The plan naming the folder its ranks run from: the code snapshot's on the cluster (content-addressed,
    so known before any upload: the script is then rendered once, with the path it will run from and the
    seal it checks; `name`: the copy the probe found, when `code/<digest>` itself changed), or, for
    a backend that runs this machine's files in place, `in_place` (the project's folder), so that a
    command's relative paths (`python3 examples/x.py`) resolve as they do on Slurm."""
    from meshrun.submit.transport import snapshot as snapshots

    if not backend(plan.cluster.scheduler).ships_code:
        return dataclasses.replace(plan, code_dir=in_place) if in_place else plan
    if snap is None:
        return plan
    return dataclasses.replace(
        plan,
        code_dir=snapshots.remote_dir(plan.work_dir, snap, name),
        code_seal=(snap.manifest_sha, snap.listing_sha),
    )


def dryrun(plan: Plan, after: Sequence[str] = ()) -> Request:
    """Everything a submit would send, rendered once; nothing is touched."""
    return backend(plan.cluster.scheduler).dryrun(plan, after)


def sync_code(
    plan: Plan,
    transport: Transport,
    snap: Optional[snapshots.Snapshot],
    progress: Optional[Progress] = None,
    present: Optional[bool] = None,
) -> bool:
    """Put the plan's code snapshot on the cluster if it is not there yet; True if it was uploaded."""
    from meshrun.submit.transport import snapshot as snapshots

    if snap is None or plan.code_dir is None:
        return False
    return snapshots.sync(transport, snap, plan.code_dir, progress, present)


def schedule(
    request: Request,
    plan: Plan,
    registry: Registry,
    transport: Transport,
    spec_dir: Path = Path("."),
    profile_path: Optional[str] = None,
) -> list[JobRecord]:
    """Send exactly `request`, then record the job (one record per sweep task)."""
    from meshrun.submit.core.registry import JobRecord, now

    with private_umask_while():  # a library caller's umask is theirs: what this writes and starts is private
        job_id = backend(request.scheduler).schedule(request, transport)
    base = JobRecord(
        job_id=job_id,
        cluster=plan.cluster.name,
        name=plan.spec.name,
        run_dir=plan.run_dir,
        scheduler=request.scheduler,
        submitted_at=now(),
        git_sha=git_sha(spec_dir),
        spec_hash=plan.spec_hash,
        profile=profile_path,
    )
    records = (
        [base]
        if not plan.tasks
        else [
            dataclasses.replace(
                base,
                job_id=f"{job_id}_{t.index}",
                name=f"{plan.spec.name} [{t.label}]",
                run_dir=t.run_dir,
                spec_hash=t.spec_hash,
            )
            for t in plan.tasks
        ]
    )
    for record in records:
        registry.add(record)
    return records


def trust(profile: ClusterProfile, cluster: str, fingerprint: Union[None, str, Sequence[str]], replace: bool) -> None:
    """`meshrun trust CLUSTER`: show the profile's host key and record it, on the user's word only."""
    if profile.ssh is None:  # is_local, said so that the type checker sees it
        raise InputError("CLUSTER", cluster, "this profile has no `ssh:` section: there is no host to trust")
    from meshrun.submit.transport.trust import trust as record_host_key  # paramiko, only for this verb

    record_host_key(profile.ssh, cluster, fingerprint, replace)


def load_cluster(cluster: str) -> ClusterProfile:
    """The cluster profile by name or YAML path, checked against its scheduler: what every verb loads."""
    return check_profile(load_profile(cluster))


def check_cluster_filter(cluster: Optional[str], registry: Registry) -> None:
    """`-c NAME` on a verb that lists recorded jobs (status, top): a name with no profile and no job on record
    is a typo, refused in one line naming the known clusters, not an empty list."""
    if cluster is not None and not registry.recent(1, cluster):
        profile_path(cluster)


def is_local(profile: ClusterProfile) -> bool:
    """The one local/SSH test: a profile without `ssh:` is this machine (the local cluster, a login node)."""
    return profile.ssh is None


def home_for(profile: ClusterProfile) -> str:
    """The home that `~` in the profile's paths means: this machine's, or (over SSH) a placeholder
    that `prepare` resolves once the login node has said its own."""
    from meshrun.submit.planning.plan import REMOTE_HOME

    return os.path.expanduser("~") if is_local(profile) else REMOTE_HOME


def suspect_nodes(profile: ClusterProfile, transport: Transport) -> dict[str, Finding]:
    """The cluster's suspect nodes now (`meshrun nodes`), each with its newest finding (the default
    forget_after: a job's own `resilience.forget_after_h` may forget sooner)."""
    import time

    return suspects(job_suspects.read(transport, cluster_work_dir(profile, transport)), time.time())


def clear_suspects(profile: ClusterProfile, transport: Transport, nodes: Sequence[str]) -> list[str]:
    """`meshrun nodes --clear NODE`: the nodes are trusted again (new submits use them). Returns those that were
    suspects (a name the ledger does not hold now is left alone: clearing it would say nothing true)."""
    named = check_node_names("--clear", list(nodes))
    now_suspect = suspect_nodes(profile, transport)
    cleared = [node for node in named if node in now_suspect]
    if cleared:
        job_suspects.clear(transport, cluster_work_dir(profile, transport), cleared)
    return cleared


def cluster_work_dir(profile: ClusterProfile, transport: Transport) -> str:
    """The profile's work dir on the cluster, `~` as the cluster user's home."""
    from meshrun.submit.planning.plan import expand_home

    return expand_home(profile.paths.work_dir, transport.home()).rstrip("/")


def reaches_other_machines(scheduler: str) -> bool:
    """Whether this scheduler's jobs run on other machines than the one meshrun runs on."""
    return backend(scheduler).over_ssh


def interpreter(profile: ClusterProfile) -> str:
    """The Python the profile's jobs (and meshrun's helpers on its login node) run: its backend's choice."""
    return backend(profile.scheduler).interpreter(profile)


def poll_interval(scheduler: str, elapsed: float) -> float:
    """How often a wait asks: the backend's choice (Slurm backs off so a long wait does not hammer slurmctld)."""
    return backend(scheduler).poll_interval(elapsed)


def check_dependencies(after: Sequence[str], scheduler: str) -> None:
    """`--after JOB`: ids Slurm takes, on a scheduler that has dependencies (InputError otherwise)."""
    from meshrun.submit.schedulers.slurm_cli import dependency

    if after and not backend(scheduler).supports_dependencies:  # first: a local id is no Slurm id either
        raise InputError("--after", after[0], f"dependencies are Slurm's; the {scheduler} cluster has none")
    dependency(after)


def check_after(profile: ClusterProfile, after: Sequence[str], transport: Transport) -> None:
    """`--after`'s jobs, asked of the cluster: each exists and can still release the new job (InputError)."""
    backend(profile.scheduler).check_after(after, transport)


def plan_job(
    spec_path: Path,
    profile: ClusterProfile,
    overrides: Sequence[str] = (),
    sweep: Sequence[str] = (),
    home: Optional[str] = None,
) -> Plan:
    """Load, validate and resolve the job (a job array with `sweep`), its scheduler's own checks included:
    every input error surfaces here, before any connection. `home`: the one `~` means (default home_for)."""
    from meshrun.submit.planning.plan import plan_file

    scheduler = backend(profile.scheduler)
    home = home or home_for(profile)
    if sweep:
        from meshrun.submit.planning.sweep import plan_sweep

        if not scheduler.supports_arrays:
            raise InputError(
                "--sweep",
                sweep[0],
                f"sweeps run as Slurm job arrays, which the {profile.scheduler} cluster does not have; "
                "submit one job per value instead (--set KEY=VALUE each)",
            )
        return plan_sweep(spec_path, profile, overrides, sweep, home=home, scheduler_check=scheduler.check)
    return plan_file(spec_path, profile, overrides, home=home, scheduler_check=scheduler.check)


def plan_spec(spec: JobSpec, submitted: dict[str, Any], profile: ClusterProfile, home: Optional[str] = None) -> Plan:
    """A job given as a spec, not a file (`meshrun doctor`'s preflight), planned as plan_job plans one."""
    from meshrun.submit.planning.plan import make_plan

    home = home or home_for(profile)
    return make_plan(spec, submitted, profile, home=home, scheduler_check=backend(profile.scheduler).check)


def check_job(plan: Plan, force: bool = False) -> None:
    """Before any connection: the files the job reads where this machine sees them as the ranks will (the
    local cluster, a login node; over SSH the ranks check theirs when they start), and, unless `force`, that
    a GPU job fits its partition's memory (InputError)."""
    from meshrun.submit.planning.plan import check_files, check_fit

    if is_local(plan.cluster):
        check_files(plan)
    if not force:
        check_fit(plan)


def resolve_home(plan: Plan, transport: Transport) -> Plan:
    """The plan with the cluster's own home for `~` (one command over SSH; nothing to ask locally)."""
    from meshrun.submit.planning.plan import with_home
    from meshrun.submit.transport import snapshot as snapshots

    return plan if is_local(plan.cluster) else with_home(plan, snapshots.remote_home(transport))


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A job made ready to send, exactly as it will be sent."""

    plan: Plan
    """The plan with the cluster's home and the folder its ranks run from."""
    request: Request
    """What the backend sends: script, start argv, run-dir files, each rendered once."""
    code: Optional[snapshots.Snapshot]
    """The project's code (its snapshot), for a cluster that runs jobs from a sealed copy; None where it runs files
    in place."""
    found: Optional[snapshots.Found]
    """What the cluster said of that snapshot (None before any connection)."""
    warnings: tuple[str, ...] = ()
    """Lines to show once: the code goes to a new copy because the old one changed."""


def with_prediction(plan: Plan) -> Plan:
    """The plan whose run spec carries its step time and memory (RunInfo.prediction), for rank 0 to check the run
    against (launcher/train/plancheck.py); unchanged where the planner cannot time the job."""
    from meshrun.submit.planning.recommend import predicted

    def carrying(spec: RunSpec) -> RunSpec:  # an array's tasks each time their own spec
        found = predicted(spec.job, plan.cluster, plan.partition)
        return spec if found is None else dataclasses.replace(spec, run=dataclasses.replace(spec.run, prediction=found))

    tasks = tuple(dataclasses.replace(task, run_spec=carrying(task.run_spec)) for task in plan.tasks)
    return dataclasses.replace(plan, run_spec=carrying(plan.run_spec), tasks=tasks)


def prepare(
    plan: Plan,
    spec_dir: Path,
    transport: Optional[Transport] = None,
    after: Sequence[str] = (),
    read_only: bool = False,
    memo: Optional[dict[tuple[str, ...], Any]] = None,
) -> Prepared:
    """The plan made once, then (with a transport) one round trip asks the cluster for its home and which copy
    of the code snapshot the job runs from, then the request is built, rendered once. Without a transport
    (a dry run on this machine) nothing is asked. `read_only` (render): nothing is written on the cluster.
    `memo`: the code snapshot and the probe's answer kept for the next job prepared over the same connection
    (`-c any` prepares one per partition)."""
    from meshrun.submit.planning.plan import avoid_suspects, with_home
    from meshrun.submit.transport import snapshot as snapshots

    ships_code = backend(plan.cluster.scheduler).ships_code
    memo = memo if memo is not None else {}
    code_key = ("snapshot", str(spec_dir), repr(plan.spec.code))
    snap = _kept(memo, code_key, lambda: snapshots.collect(spec_dir, plan.spec.code)) if ships_code else None
    found: Optional[snapshots.Found] = None
    warnings: tuple[str, ...] = tuple(snapshots.left_out_warning(snap)) if snap is not None else ()
    if transport is not None and after:
        check_after(plan.cluster, after, transport)  # before anything is written or sent
    probed: Optional[snapshots.Probed] = None
    if transport is not None and (not is_local(plan.cluster) or snap is not None):
        # The suspect-node ledger comes in the same round trip as the home and the code snapshot's copy.
        ledger = LEDGER if reaches_other_machines(plan.cluster.scheduler) else ""
        probe_key = ("probe", plan.work_dir, snap.digest if snap else "", str(read_only), ledger)
        asking = transport
        probed = _kept(
            memo,
            probe_key,
            lambda: snapshots.probe_all(asking, plan.work_dir, snap, read_only=read_only, ledger=ledger),
        )
        home, found = probed.home, probed.found
        if not is_local(plan.cluster):
            plan = with_home(plan, home)
        if found is not None and not found.present:
            warnings += tuple(snapshots.changed_warning(plan.work_dir, found))
    if transport is not None and reaches_other_machines(plan.cluster.scheduler):
        # The cluster's suspect nodes (a hang verdict blamed them) are left out, as far as the partition can spare.
        lines = probed.suspect_lines if probed is not None else None
        rows = parse_suspects(lines) if lines is not None else job_suspects.read(transport, plan.work_dir)
        plan, avoided = avoid_suspects(plan, rows)
        warnings += avoided
    in_place = None if ships_code else str(snapshots.project_root(spec_dir, plan.spec.code) or spec_dir.resolve())
    plan = with_prediction(with_code_dir(plan, snap, in_place, found.name if found else None))
    return Prepared(plan, dryrun(plan, after), snap, found, warnings)


def _kept(memo: dict[tuple[str, ...], Any], key: tuple[str, ...], make: Callable[[], Any]) -> Any:
    """memo[key], made once."""
    if key not in memo:
        memo[key] = make()
    return memo[key]


def preflight(prepared: Prepared, transport: Transport) -> Preflight:
    """What would end the job in its first second, asked of the cluster in one round trip before it queues
    (submit/schedulers/preflight.py): Slurm's verdict and start estimate, the files the ranks read, the
    interpreter after the profile's setup lines, free space for the checkpoints."""
    from meshrun.submit.schedulers import preflight as checks

    local = not reaches_other_machines(prepared.plan.cluster.scheduler)
    # Where check_job read the data files here (this machine sees them as the ranks will), once is enough.
    return checks.run(
        prepared.plan, prepared.request, transport, local, inspect_data=not is_local(prepared.plan.cluster)
    )


ANY_CLUSTER = "any"
"""`-c any`: every cluster profile the user has written (in ~/.config/meshrun/clusters), each of its partitions."""


def clusters_asked(cluster: str) -> Optional[list[str]]:
    """`-c any` or `-c a,b,c`: the profiles a submit chooses among (in the order given); None for one cluster."""
    if cluster == ANY_CLUSTER:
        from meshrun.submit.config.cluster import user_dir

        names = sorted(path.stem for path in user_dir().glob("*.yaml")) if user_dir().is_dir() else []
        if not names:
            raise InputError(
                "-c/--cluster",
                ANY_CLUSTER,
                f"you have no cluster profiles yet: write one in {user_dir()}, or name them",
            )
        return names
    if "," not in cluster:
        return None
    names = [name.strip() for name in cluster.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise InputError("-c/--cluster", cluster, "give distinct profile names separated by commas, e.g. -c a,b")
    return names


ASK_WORKERS = 8
"""Login nodes asked at once by `-c any` (each its own connection): enough for every cluster a user writes
profiles for, few enough not to open dozens of SSH connections together."""


@dataclasses.dataclass(frozen=True)
class _Asked:
    """One partition's question to a login node: the profile (as `-c` named it) and the job planned there."""

    given: str
    profile: ClusterProfile
    part: str
    plan: Plan

    def failed(self, why: str) -> Candidate:
        return Candidate(self.profile.name, self.part, None, why, self.given)


def candidates(spec_path: Path, names: Sequence[str], overrides: Sequence[str] = ()) -> list[Candidate]:
    """Plan the job on each profile (on each of its partitions, unless the spec names one), drop where it cannot
    fit, and ask each login node the preflight's questions, Slurm's start estimate among them (read-only: nothing
    is written or queued anywhere), in the order written. Profiles that reach the same login node share ONE
    connection and ONE round trip for all their partitions' checks; different login nodes are asked in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    slots: list[Optional[Candidate]] = []
    nodes: dict[tuple[str, ...], list[tuple[int, _Asked]]] = {}
    for given in names:
        for item in _planned(spec_path, given, overrides):  # every input error before any connection
            if isinstance(item, _Asked):
                nodes.setdefault(login_node(item.profile), []).append((len(slots), item))
                slots.append(None)
            else:
                slots.append(item)
    if nodes:
        with ThreadPoolExecutor(max_workers=min(ASK_WORKERS, len(nodes))) as pool:
            for answers in pool.map(lambda asked: _ask_node(spec_path, asked), nodes.values()):
                for index, candidate in answers:
                    slots[index] = candidate
    return [c for c in slots if c is not None]


def _planned(spec_path: Path, given: str, overrides: Sequence[str]) -> list[Union[Candidate, _Asked]]:
    """The profile's partitions to ask (a refusal, as a Candidate that cannot run the job, where it cannot)."""
    try:
        profile = load_cluster(given)
        pinned = plan_job(spec_path, profile, overrides).spec.resources.partition
    except (InputError, ClusterError) as exc:
        return [Candidate(given, "-", None, str(exc), given)]
    parts = [pinned] if pinned else [p.name for p in profile.partitions] or [""]
    found: list[Union[Candidate, _Asked]] = []
    for part in parts:
        sets = [*overrides, f"resources.partition={part}"] if part and not pinned else list(overrides)
        try:
            plan = plan_job(spec_path, profile, sets)
            check_job(plan)
            found.append(_Asked(given, profile, part or "-", plan))
        except (InputError, ClusterError) as exc:
            found.append(Candidate(profile.name, part or "-", None, str(exc), given))
    return found


def login_node(profile: ClusterProfile) -> tuple[str, ...]:
    """Where a profile's commands run: this machine, or the SSH target (host name, port, user, and the hops to
    it) its ssh section resolves to. Profiles with the same login node are asked over one connection."""
    if profile.ssh is None:
        return ("this machine",)
    from meshrun.submit.transport.sshconfig import Target, resolve

    try:
        target: Optional[Target] = resolve(profile.ssh)
    except (InputError, ClusterError):  # said when it connects; keyed as written meanwhile
        return ("ssh", profile.ssh.host, str(profile.ssh.port), str(profile.ssh.user), str(profile.ssh.proxy_jump))
    key: list[str] = ["ssh"]
    while target is not None:
        key += [target.hostname, str(target.port), target.user, target.proxy_command or ""]
        target = target.jump
    return tuple(key)


def _ask_node(spec_path: Path, asked: Sequence[tuple[int, _Asked]]) -> list[tuple[int, Candidate]]:
    """Every question for one login node over one connection: a probe per work dir and code snapshot (home,
    code copy, suspect nodes), then every partition's preflight in ONE round trip."""
    first = asked[0][1]
    try:
        transport = connect(first.profile.ssh, first.given)
    except ClusterError as exc:
        return [(index, item.failed(str(exc))) for index, item in asked]
    try:
        memo: dict[tuple[str, ...], Any] = {}
        answers: list[tuple[int, Candidate]] = []
        ready: list[tuple[int, _Asked, Prepared]] = []
        for index, item in asked:
            try:
                ready.append((index, item, prepare(item.plan, spec_path.parent, transport, read_only=True, memo=memo)))
            except (InputError, ClusterError) as exc:
                answers.append((index, item.failed(str(exc))))
        return answers + _preflights(ready, transport)
    finally:
        transport.close()


def _preflights(ready: Sequence[tuple[int, _Asked, Prepared]], transport: Transport) -> list[tuple[int, Candidate]]:
    """Each partition's preflight, all in ONE round trip to the login node. A question two partitions ask alike
    is asked once: the same command (a profile's interpreter check), or the same request to Slurm (profiles that
    differ only in what Slurm does not schedule by). Each Slurm estimate comes with the login node's clock, read
    just before it, and the partition's idle nodes."""
    from meshrun.submit.schedulers import preflight as checks
    from meshrun.submit.schedulers.slurm import CLOCK_ARGV, free_nodes, free_nodes_argv, scheduled_by

    argvs: list[Sequence[str]] = []
    seen: dict[tuple[str, ...], int] = {}

    def slot(argv: Sequence[str], key: tuple[str, ...] = ()) -> int:
        key = key or tuple(argv)
        if key not in seen:
            seen[key] = len(argvs)
            argvs.append(argv)
        return seen[key]

    shares = []
    for _, item, prepared in ready:
        planned = _preflight_commands(prepared)
        question = ("slurm", *scheduled_by(prepared.request.script))
        clock: Optional[int] = None
        picked = []
        for what, argv in planned:
            if what == "slurm":  # the clock, then at once Slurm's estimate
                clock = slot(CLOCK_ARGV, ("clock", *question))
            picked.append(slot(argv, question if what == "slurm" else ()))
        sinfo = slot(free_nodes_argv(item.part)) if clock is not None and item.part != "-" else None
        shares.append((planned, clock, picked, sinfo))
    try:
        results = batch(transport, argvs, timeout=120) if argvs else []
    except ClusterError as exc:
        return [(index, item.failed(str(exc))) for index, item, _ in ready]
    answers = []
    for (index, item, prepared), (planned, clock, picked, sinfo) in zip(ready, shares):
        checked = checks.judge(prepared.plan, planned, [results[k] for k in picked])
        now = results[clock].stdout.strip() if clock is not None else ""
        free = free_nodes(results[sinfo]) if sinfo is not None else None
        answers.append((index, _timed(_candidate(item, checked, now, free), item.plan)))
    return answers


def _preflight_commands(prepared: Prepared) -> list[tuple[str, list[str]]]:
    """The preflight's (check, argv) for a prepared job, as `preflight` asks them."""
    from meshrun.submit.schedulers import preflight as checks

    plan = prepared.plan
    local = not reaches_other_machines(plan.cluster.scheduler)
    return checks.commands(plan, prepared.request, local, inspect_data=not is_local(plan.cluster))


def _timed(candidate: Candidate, plan: Plan) -> Candidate:
    """The candidate with the planner's step time on its partition (built-in trainer jobs only)."""
    from meshrun.submit.planning.recommend import estimated_step

    if plan.spec.command is not None or plan.partition is None:
        return candidate
    step = estimated_step(plan.spec, plan.cluster, plan.partition)
    steps = plan.spec.trainer.steps
    return dataclasses.replace(candidate, step_s=step.step_s if step else None, steps=steps)


def _candidate(item: _Asked, checked: Preflight, now: str, free: Optional[int]) -> Candidate:
    """The partition's answer: the first failed check, or when it would start (the wait read against `now`, the
    login node's clock as it answered), with the job's time limit and the partition's idle nodes."""
    if checked.failures:
        first = checked.failures[0]
        return item.failed(f"{first.what}: {first.line}")
    start, why = (
        (checked.start, f"Slurm's estimate: {checked.start}") if checked.start else ("now", "starts jobs at once")
    )
    wait = wait_seconds(start, now) if checked.start else 0.0
    limit = item.plan.time_seconds
    return Candidate(item.profile.name, item.part, start, why, item.given, wait_s=wait, limit_s=limit, free_nodes=free)


def upload(prepared: Prepared, transport: Transport, progress: Optional[Progress] = None) -> Prepared:
    """The code snapshot put on the cluster unless it is there; the result says it is there now."""
    found = prepared.found
    if not sync_code(prepared.plan, transport, prepared.code, progress, found.present if found else None):
        return prepared
    present = dataclasses.replace(found, present=True) if found is not None else None
    return dataclasses.replace(prepared, found=present)


def send(
    prepared: Prepared,
    registry: Registry,
    transport: Transport,
    spec_dir: Path = Path("."),
    profile_path: Optional[str] = None,
    progress: Optional[Progress] = None,
) -> tuple[list[JobRecord], bool]:
    """The code snapshot if it is not on the cluster yet, then exactly the prepared request; the job
    recorded. Returns the records (one per sweep task) and whether code was uploaded."""
    uploaded = upload(prepared, transport, progress) is not prepared
    records = schedule(prepared.request, prepared.plan, registry, transport, spec_dir, profile_path)
    return records, uploaded


def submit(
    plan: Plan,
    registry: Registry,
    transport: Transport,
    spec_dir: Path = Path("."),
    after: Sequence[str] = (),
    profile_path: Optional[str] = None,
    force: bool = False,
    check: bool = True,
) -> list[JobRecord]:
    """`meshrun submit`'s road for a Python caller: check_job, prepare, the preflight (unless not `check`;
    a failed one raises InputError naming every failed check), send (code snapshot included)."""
    check_job(plan, force)
    prepared = prepare(plan, spec_dir, transport, after)
    if check:
        failed = preflight(prepared, transport).failures
        if failed:
            raise InputError("preflight", ", ".join(c.what for c in failed), "; ".join(c.line for c in failed))
    return send(prepared, registry, transport, spec_dir, profile_path)[0]


class Clusters:
    """Profiles and open transports: one connection per cluster for the whole command.

    A cluster is keyed by the profile FILE a job was submitted with (the registry keeps its path), so
    a job always goes back to its own cluster, whatever other profiles are called today."""

    def __init__(self) -> None:
        self._profiles: dict[str, ClusterProfile] = {}
        self._transports: dict[str, Transport] = {}

    @staticmethod
    def key(record: JobRecord) -> str:
        return record.profile or record.cluster

    def profile(self, key: str) -> ClusterProfile:
        """The profile behind a key: a profile file's path, or (records of old) a profile name."""
        if key not in self._profiles:
            if is_profile_path(key):
                if not Path(key).is_file():
                    raise InputError(
                        "cluster profile", key, "the profile file this job was submitted with is gone; restore it"
                    )
                self._profiles[key] = check_profile(load_profile_file(Path(key)))
            else:
                self._profiles[key] = load_cluster(key)
        return self._profiles[key]

    def profile_for(self, record: JobRecord) -> ClusterProfile:
        return self.profile(self.key(record))

    def transport(self, key: str) -> Transport:
        if key not in self._transports:
            # The key, not the profile's name: a refused host key's fix (`meshrun trust KEY`) must name
            # the file a job was submitted with (-c my.yaml), which `meshrun trust NAME` would not find.
            self._transports[key] = connect(self.profile(key).ssh, key)
        return self._transports[key]

    def transport_for(self, record: JobRecord) -> Transport:
        """The connection to the record's cluster (its profile reloaded from the file it was submitted with)."""
        return self.transport(self.key(record))

    def reconnect(self, record: JobRecord) -> Transport:
        """Drop the (lost) connection to the record's cluster and open a new one."""
        old = self._transports.pop(self.key(record), None)
        if old is not None:
            try:
                old.close()
            except Exception:
                pass  # it is already gone
        return self.transport_for(record)

    def adopt(self, profile: ClusterProfile, transport: Transport, path: str) -> None:
        """Reuse a connection the caller already opened (one connection per command)."""
        self._profiles[path] = profile
        self._transports[path] = transport

    def close(self) -> None:
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()


def cancel(records: Sequence[JobRecord], clusters: Clusters, registry: Optional[Registry] = None) -> None:
    """Cancel a job, or a whole job array (records: its tasks); a job that already ended is an error."""
    found = statuses(records, clusters, registry)
    if all(s.done for s in found):
        states = sorted({s.state for s in found})
        raise ClusterError(
            f"job {records[0].job_id if len(records) == 1 else records[0].job_id.split('_')[0]} "
            f"already ended ({', '.join(states)}): nothing to cancel"
        )
    record = records[0]
    backend(record.scheduler).cancel(records, clusters.transport_for(record))


def statuses(
    records: Sequence[JobRecord],
    clusters: job_status.TransportSource,
    registry: Optional[Registry] = None,
    warn: Optional[Callable[[str], None]] = None,
    detail: bool = False,
    live: bool = False,
) -> list[Status]:
    """The status of each record, in order: one round trip per cluster, each asked of the record's scheduler
    backend (submit/core/status.py's statuses; `warn` (default: a warning line on stderr), `detail` and `live`
    as there)."""
    from meshrun.submit.core import status as job_status

    to = warn if warn is not None else job_status.warn_to_stderr
    return job_status.statuses(records, clusters, backend, registry, to, detail, live)


def resume(
    record: JobRecord, transport: Transport, registry: Registry, status: Status, overrides: Sequence[str] = ()
) -> JobRecord:
    """`meshrun resume`: the ended job (`status`: its status now) started again in its run dir by its own
    scheduler backend (submit/jobs/checkpoints.py's resume); the new job's record."""
    from meshrun.submit.jobs.checkpoints import resume as restart_job

    restart = backend(record.scheduler).restart
    return restart_job(record, transport, registry, status.state, status.done, restart, overrides)


def log_path(record: JobRecord, rank: Optional[int]) -> str:
    """rank N's log, or (rank None) the batch shell's / local supervisor's log."""
    if rank is not None and rank < 0:
        raise InputError("--rank", rank, "ranks are numbered from 0")
    return backend(record.scheduler).log_path(record, rank)
