"""Planning: job spec + cluster profile + --set overrides -> a validated, resolved job.

Pure: reads files, touches no cluster. Every check here runs before anything is
submitted, and each error names the key, the value and the fix.
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from meshrun.launcher.contract.nodelist import compress
from meshrun.launcher.contract.records import suspects
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec import dsconfig, presets, schema, tokens
from meshrun.launcher.contract.spec.job import JobSpec, Resources, RunInfo, RunSpec, check_ranges
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.submit import __version__
from meshrun.submit.config.cluster import ClusterProfile, Partition, check_node_names
from meshrun.submit.config.yamlfile import YamlDoc
from meshrun.submit.core import secrets as job_secrets
from meshrun.submit.core.plan import Plan, parse_time
from meshrun.submit.errors import InputError
from meshrun.submit.textwidth import slug

SchedulerCheck = Callable[[JobSpec, ClusterProfile], None]
"""A scheduler's own plan-time checks of a spec on a profile (its backend's `check`; InputError), handed in by
the caller: planning never looks a scheduler up (submit/api.py does, and hands its backend's in)."""


def load_job(path: Path, overrides: Sequence[str] = ()) -> tuple[JobSpec, dict[str, Any]]:
    """Read a job spec file strictly and apply `--set` overrides."""
    doc = YamlDoc(path)
    if not isinstance(doc.data, dict):
        raise InputError(str(path), doc.data, "a job spec is a mapping with at least `name:`")
    try:
        data = schema.apply_overrides(JobSpec, doc.data, overrides)
    except SchemaError as exc:
        raise _override_error(exc, overrides) from None
    data = expand_preset(data, overrides)
    try:
        spec = schema.load(JobSpec, data)
        check_ranges(spec)  # here too (make_plan checks it again): an error here knows the overrides
        return spec, data
    except SchemaError as exc:
        if set_by_override(exc.key, overrides):  # the value came from the command line, not the file's line
            raise _override_error(exc, overrides) from None
        raise doc.error(exc) from None


def _override_error(exc: SchemaError, overrides: Sequence[str]) -> InputError:
    """A --set's error; one naming an unknown key shows the whole override and the name that is wrong
    (`--set trian.steps=10: 'trian': unknown key (did you mean 'train'?)`), not the value it would set."""
    if exc.fix.startswith("unknown key"):
        given = next((o for o in overrides if o.split("=", 1)[0].startswith(exc.key)), None)
        if given is not None:
            return InputError(f"--set {given}", exc.key.rsplit(".", 1)[-1], exc.fix)
    return InputError(f"--set {exc.key}", exc.value, exc.fix)


def set_by_override(key: str, overrides: Sequence[str]) -> bool:
    """Whether KEY (a.b.c, or a.b[2].c) lies under a key some --set gave: its value is the override's."""
    plain = key.split("[", 1)[0]
    return any(plain == given or plain.startswith(given + ".") for given in _set_keys(overrides))


def _set_keys(overrides: Sequence[str]) -> set[str]:
    return {item.split("=", 1)[0].strip() for item in overrides}


def expand_preset(data: dict[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """`train.model.preset` -> its shape keys (launcher/contract/spec/presets.py). Keys given explicitly win: a preset in
    the file yields to the file's (and --set's) model keys; a preset given by --set replaces the file's
    model keys and yields only to --set's, so `--set train.model.preset=llama-70b` sizes any spec."""
    train = data.get("train")
    model = train.get("model") if isinstance(train, dict) else None
    if not isinstance(train, dict) or not isinstance(model, dict) or model.get("preset") is None:
        return data
    name = model["preset"]
    if not isinstance(name, str) or name not in presets.PRESETS:
        valid = ", ".join(presets.PRESETS)
        raise InputError(
            "train.model.preset", name, f"unknown preset{schema.closest(str(name), presets.PRESETS)}; valid: {valid}"
        )
    given = _set_keys(overrides)
    if "train.model.preset" in given:
        explicit = {k: v for k, v in model.items() if f"train.model.{k}" in given}
    else:
        explicit = dict(model)
    expanded = {**presets.preset(name), **explicit, "preset": name}
    return {**data, "train": {**train, "model": expanded}}


def check_tasks(spec: JobSpec) -> None:
    """GPU jobs run one rank per GPU: tasks_per_node, when given, is gpus_per_node."""
    res = spec.resources
    if res.gpus_per_node and res.tasks_per_node is not None and res.tasks_per_node != res.gpus_per_node:
        raise InputError(
            "resources.tasks_per_node",
            res.tasks_per_node,
            f"GPU jobs run one rank per GPU: set it to resources.gpus_per_node ({res.gpus_per_node}) or leave it unset",
        )


def check_resources(spec: JobSpec, cluster: ClusterProfile) -> Optional[Partition]:
    """The resources against the cluster's partition: GPUs, CPUs, nodes, memory, time (after check_tasks and
    the scheduler's own checks, which make_plan runs first)."""
    part = fit_partition(spec.resources, spec.tasks_per_node, cluster)
    res = spec.resources
    spares = spec.resilience.spare_nodes  # (the local backend's own check refuses any: one machine)
    if spares and part.max_nodes is not None and res.nodes + spares > part.max_nodes:
        roomy = [
            f"{p.name} ({p.max_nodes} nodes)" for p in cluster.partitions if (p.max_nodes or 0) >= res.nodes + spares
        ]
        elsewhere = f", or a partition with room (resources.partition: {', '.join(roomy)})" if roomy else ""
        raise InputError(
            "resilience.spare_nodes",
            spares,
            f"{res.nodes} node{'s' if res.nodes > 1 else ''} + {spares} spare{'s' if spares > 1 else ''} > the {part.max_nodes} nodes of partition "
            f"{part.name!r}; ask for fewer{elsewhere}",
        )
    return part


def fit_partition(
    res: Resources, tasks_per_node: int, cluster: ClusterProfile, prefix: str = "resources."
) -> Partition:
    """The resources against the cluster's partition: GPUs, CPUs, nodes, memory, time. Errors name each
    key with `prefix` (the spec's `resources.`, or nothing for the Python API's keywords)."""
    try:
        part = cluster.partition(res.partition)
    except InputError as exc:
        raise InputError(f"{prefix}partition", exc.value, exc.fix) from None
    seconds = parse_time(res.time, f"{prefix}time")
    if res.gpus_per_node > part.gpus_per_node:
        raise InputError(
            f"{prefix}gpus_per_node",
            res.gpus_per_node,
            f"a node of partition {part.name!r} has {part.gpus_per_node} GPUs; ask for at most that",
        )
    cpus = tasks_per_node * res.cpus_per_task
    if cpus > part.cpus_per_node:
        raise InputError(
            f"{prefix}cpus_per_task",
            res.cpus_per_task,
            f"tasks_per_node({tasks_per_node})*cpus_per_task({res.cpus_per_task})={cpus} "
            f"> {part.cpus_per_node} CPUs per node of {part.name!r}; lower one of them",
        )
    if part.max_nodes is not None and res.nodes > part.max_nodes:
        raise InputError(f"{prefix}nodes", res.nodes, f"partition {part.name!r} allows at most {part.max_nodes} nodes")
    if part.memory_gb is not None and res.memory_gb is not None and res.memory_gb > part.memory_gb:
        raise InputError(
            f"{prefix}memory_gb",
            res.memory_gb,
            f"a node of {part.name!r} has {part.memory_gb} GiB; ask for at most that",
        )
    if part.max_time is not None and seconds > parse_time(part.max_time, f"partitions[{part.name}].max_time"):
        raise InputError(
            f"{prefix}time",
            res.time,
            f"partition {part.name!r} allows at most {part.max_time}; ask for less or pick another partition",
        )
    return part


def check_parallel(spec: JobSpec, cluster: ClusterProfile) -> None:
    """dp x tp x pp against the ranks, the NVLink domain and the model shape."""
    if spec.command is not None:
        return  # the user's own program decides its parallelism
    p, t = spec.parallel, spec.trainer
    domain = cluster.interconnect.nvlink_domain
    if spec.resources.gpus_per_node and p.tp > domain:
        raise InputError(
            "parallel.tp",
            p.tp,
            f"tensor parallelism must stay inside one NVLink/NVSwitch domain "
            f"of {domain} GPUs on {cluster.name!r}; use tp <= {domain}",
        )
    dims = spec.dims
    problem = spec.layout_problem(dims)
    if problem:
        raise InputError(problem.key, problem.value, problem.fix)
    problem = dims.batch_problem(t.global_batch, t.micro_batch)
    if problem:
        raise InputError(problem.key, problem.value, problem.fix)
    if not spec.resources.gpus_per_node and t.precision != "fp32":
        raise InputError(
            "train.precision", t.precision, "CPU ranks train in fp32; set train.precision=fp32 or ask for GPUs"
        )


def check_fit(plan: Plan) -> None:
    """Refuse a GPU trainer job whose estimated memory per GPU exceeds its partition's (submit; --force skips
    this): one line with the plan's numbers and the nearest layout that fits (submit/planning/recommend.py).
    CPU jobs, command jobs and partitions of unknown GPU memory are never refused."""
    from meshrun.submit.planning import estimate, recommend
    from meshrun.submit.planning.estimate import gib as _gib

    part = plan.partition
    specs = [task.run_spec.job for task in plan.tasks] or [plan.spec]
    for spec in specs:
        if part is None or spec.command is not None or not spec.resources.gpus_per_node:
            continue
        size = recommend.gpu_memory(part)
        memory = estimate.memory_per_gpu(spec)
        if estimate.fits(memory, size) is not False:
            continue
        assert size is not None
        p = spec.parallel
        layout = f"dp={p.dp} tp={p.tp} pp={p.pp} " + (
            f"zero={dsconfig.zero_stage(spec)}" if dsconfig.uses_deepspeed(spec) else p.dp_mode
        )
        raise InputError(
            "parallel",
            layout,
            f"needs {_gib(memory.total)} per GPU (params {_gib(memory.params)}, grads {_gib(memory.grads)}, "
            f"optimizer {_gib(memory.optimizer)}, activations {_gib(memory.activations)}, allowance "
            f"{_gib(memory.allowance)}) > {_gib(estimate.usable_bytes(size))} usable of {size:g} GiB on partition "
            f"{part.name!r} ({part.gpu_type or 'GPU'}); {recommend.nearest_fix(spec, plan.cluster, part)} "
            f"(`meshrun plan` shows the estimate; --force submits anyway)",
        )


def expand_home(path: str, home: str) -> str:
    """`~` and `~/x` -> the cluster user's home (resolved by the transport, not this machine's)."""
    if path == "~" or path.startswith("~/"):
        return home.rstrip("/") + path[1:]
    return path


def run_dir_for(spec: JobSpec, cluster: ClusterProfile, home: str, now: Optional[_dt.datetime] = None) -> str:
    """<work_dir>/runs/<name>-<UTC time>-<random>: unique, sortable, readable."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    stamp = now.strftime("%Y%m%d-%H%M%S")
    base = expand_home(cluster.paths.work_dir, home).rstrip("/")
    return f"{base}/runs/{slug(spec.name)}-{stamp}-{secrets.token_hex(4)}"


def check_files(plan: Plan) -> None:
    """The files the ranks will read (data, init weights) exist, where this machine sees their filesystem
    (the local cluster, a login node; not a laptop: over SSH the ranks check when they start). At submit
    time, beside check_fit: planning and rendering a job need no data."""
    from meshrun.launcher.contract.spec import (
        weights,  # here: only a submit reads init weights' headers (render never does)
    )

    home = os.path.expanduser("~")
    tokens.check_data_files(plan.spec, home)
    weights.check_init_from(plan.spec, home)


def make_plan(
    spec: JobSpec,
    submitted: dict[str, Any],
    cluster: ClusterProfile,
    run_dir: Optional[str] = None,
    home: Optional[str] = None,
    scheduler_check: Optional[SchedulerCheck] = None,
) -> Plan:
    """Validate everything, then resolve the run dir. `home` is the cluster user's home; `scheduler_check` the
    profile's scheduler's own checks (api.plan_job hands them in; None: none, e.g. a test of planning alone)."""
    try:
        check_ranges(spec)
    except SchemaError as exc:  # the planner's callers catch InputError, the contract raises its base
        raise InputError(exc.key, exc.value, exc.fix) from None
    home = home or os.path.expanduser("~")
    if home != REMOTE_HOME:  # the ranks' files may be visible from here (the local cluster, a login node)
        spec = tokens.resolve_vocab(spec, home)
    # Secrets: every env: source set here, file: sources private where visible; before any connection.
    job_secrets.check(spec, cluster, visible=home != REMOTE_HOME)
    check_tasks(spec)
    if scheduler_check is not None:
        scheduler_check(spec, cluster)
    part = check_resources(spec, cluster)
    check_parallel(spec, cluster)
    run_dir = run_dir or run_dir_for(spec, cluster, home)
    ckpt_root = cluster.paths.checkpoint_root and expand_home(cluster.paths.checkpoint_root, home)
    ckpt_dir = f"{ckpt_root.rstrip('/')}/{Path(run_dir).name}" if ckpt_root else f"{run_dir}/checkpoints"
    # Node-local, and often shared by every user of the node: one private folder per user ($USER, like
    # `~`, is expanded on the node itself: meshrun.launcher.contract.records.rundir.expand_node_path), one per run inside it.
    scratch = cluster.paths.scratch
    scratch_dir = f"{scratch.rstrip('/')}/meshrun-$USER/{Path(run_dir).name}" if scratch else ""
    info = RunInfo(
        cluster=cluster.name,
        scheduler=cluster.scheduler,
        run_dir=run_dir,
        nccl_env=dict(cluster.interconnect.nccl),
        checkpoint_dir=ckpt_dir,
        scratch_dir=scratch_dir,
        time_limit_s=parse_time(spec.resources.time),
        meshrun_version=__version__,
        gpu_type=(part.gpu_type or "") if part else "",
        suspects_file=suspects.ledger_path(expand_home(cluster.paths.work_dir, home).rstrip("/")),
        gpu_hour_price=cluster.cost.gpu_hour if spec.resources.gpus_per_node else 0.0,
        currency=cluster.cost.currency if cluster.cost.gpu_hour and spec.resources.gpus_per_node else "",
    )
    return Plan(
        spec=spec,
        submitted=submitted,
        cluster=cluster,
        partition=part,
        run_dir=run_dir,
        time_seconds=parse_time(spec.resources.time),
        run_spec=RunSpec(job=spec, run=info),
        work_dir=expand_home(cluster.paths.work_dir, home).rstrip("/") or "/",
    )


REMOTE_HOME = "~"
"""The home to plan with before the cluster has been asked for its own: paths keep their `~`,
and `with_home` resolves them once the transport knows it (no second plan, same run dir)."""


def _rehome(path: str, home: str) -> str:
    return expand_home(path, home) if path else path


def with_home(plan: Plan, home: str) -> Plan:
    """The plan with `~` in every cluster path replaced by the cluster user's real home."""

    def run_spec(spec: RunSpec) -> RunSpec:
        run = replace(
            spec.run,
            run_dir=_rehome(spec.run.run_dir, home),
            checkpoint_dir=_rehome(spec.run.checkpoint_dir, home),
            suspects_file=_rehome(spec.run.suspects_file, home),
        )
        return replace(spec, run=run)

    tasks = tuple(replace(t, run_dir=_rehome(t.run_dir, home), run_spec=run_spec(t.run_spec)) for t in plan.tasks)
    return replace(
        plan,
        run_dir=_rehome(plan.run_dir, home),
        work_dir=_rehome(plan.work_dir, home),
        code_dir=_rehome(plan.code_dir, home) if plan.code_dir else None,
        run_spec=run_spec(plan.run_spec),
        tasks=tasks,
    )


def plan_file(
    path: Path,
    cluster: ClusterProfile,
    overrides: Sequence[str] = (),
    run_dir: Optional[str] = None,
    home: Optional[str] = None,
    scheduler_check: Optional[SchedulerCheck] = None,
) -> Plan:
    """The job spec file planned (make_plan) with its `--set` overrides."""
    spec, submitted = load_job(path, overrides)
    return make_plan(spec, submitted, cluster, run_dir, home, scheduler_check)


def _engine(plan: Plan) -> dict[str, Any]:
    """The engine, and for DeepSpeed its ZeRO stage, what is offloaded and where its config is written."""
    spec = plan.spec
    if not dsconfig.uses_deepspeed(spec):
        return {"engine": spec.trainer.engine}
    par = spec.parallel
    return {
        "engine": "deepspeed",
        "zero": dsconfig.zero_stage(spec),
        "offload": dsconfig.offload(par.offload_optimizer, par.offload_params) or "none",
        "deepspeed_config": RunDir(plan.run_dir).path(RunDir.DEEPSPEED_CONFIG),
    }


def describe(plan: Plan) -> dict[str, Any]:
    """A short summary for humans and --dry-run."""
    spec = plan.spec
    out: dict[str, Any] = {
        "name": spec.name,
        "cluster": plan.cluster.name,
        "run_dir": plan.run_dir,
        "nodes": spec.resources.nodes,
        "tasks_per_node": spec.tasks_per_node,
        "gpus_per_node": spec.resources.gpus_per_node,
    }
    if spec.command is None:
        t, p = spec.trainer, spec.parallel
        out.update(dp=p.dp, tp=p.tp, pp=p.pp, dp_mode=p.dp_mode, accumulation=t.global_batch // (t.micro_batch * p.dp))
        out.update(_engine(plan))
        if out["engine"] == "deepspeed":
            del out["dp_mode"]  # ZeRO shards instead; dp_mode is the native engine's
        if p.pp > 1:  # the accumulation micro-batches are the pipeline's
            out["pp_schedule"] = p.pp_schedule
        if p.tp > 1:
            out["sequence_parallel"] = p.sequence_parallel
    if spec.secrets:  # names and sources, never a value
        out["secrets"] = job_secrets.sources(spec)
    if plan.tasks:
        out["tasks"] = [
            {"index": task.index, "overrides": dict(task.overrides), "run_dir": task.run_dir} for task in plan.tasks
        ]
    return out


# ----------------------------------------------------------------- suspect nodes


def avoid_suspects(
    plan: Plan, rows: Sequence[Mapping[str, Any]], now: Optional[float] = None
) -> tuple[Plan, tuple[str, ...]]:
    """The plan with the cluster's suspect nodes left out (its defaults.exclude grown), as many as the partition
    can spare beside the job's own nodes; the lines that say which were left out, and which were kept in."""
    import time

    now = time.time() if now is None else now
    cluster, spec = plan.cluster, plan.spec
    if not spec.resilience.avoid_suspects:
        return plan, ()
    found = suspects.suspects(rows, now, spec.resilience.forget_after_h * 3600)
    already = list(cluster.defaults.exclude)
    new = [node for node in sorted(found) if node not in already]
    try:
        new = list(check_node_names("suspect nodes", new))
    except InputError:  # a name no script may carry (a garbled ledger): none of them is used
        return plan, ("the suspect-node ledger holds a name meshrun cannot pass to sbatch: not used",)
    if not new:
        return plan, ()
    total = plan.partition.max_nodes if plan.partition else None
    needed = spec.resources.nodes + spec.resilience.spare_nodes  # the job's own nodes and its spares
    spare = len(new) if total is None else max(0, total - len(already) - needed)
    left_out, kept = new[:spare], new[spare:]
    where = f"`meshrun nodes -c {cluster.name}` lists them; `--clear NODE` trusts one again"
    lines = [
        f"leaving out suspect node {node} ({found[node].evidence}; job {found[node].job}, "
        f"{suspects.ago(now - found[node].time)}); {where}"
        for node in left_out
    ]
    if kept:
        lines.append(
            f"suspect node(s) {compress(kept)} kept in: the job needs {spec.resources.nodes} of partition "
            f"{plan.partition.name if plan.partition else '?'}'s {total} nodes; {where}"
        )
    if not left_out:
        return plan, tuple(lines)
    defaults = replace(cluster.defaults, exclude=tuple([*already, *left_out]))
    return replace(plan, cluster=replace(cluster, defaults=defaults)), tuple(lines)
