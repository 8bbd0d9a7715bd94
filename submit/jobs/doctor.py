"""`meshrun doctor`: the preflight job's spec, and the pass/warn/fail verdict per node from its results.

The job is an ordinary `command:` job (`python -m meshrun.launcher.probes.doctor` on every rank: one per GPU, or two per
node on a CPU cluster) that goes through the normal submission path. Each rank writes
RUN_DIR/doctor/rank-N.json (launcher/probes/doctor.py); `judge` turns those files into one row per node. Pure:
no cluster is touched here (submit/cli/doctor.py submits, waits and reads).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

from meshrun.launcher.contract.gpus import peak_tflops
from meshrun.launcher.contract.nodelist import compress
from meshrun.submit.config.cluster import ClusterProfile, Interconnect, Partition, check_node_names
from meshrun.submit.errors import InputError

Verdict = Literal["pass", "warn", "fail", "skip"]
RANK_ORDER = {"skip": 0, "pass": 1, "warn": 2, "fail": 3}
SLOW_WARN = 0.5
"""A node below this share of the fastest node's figure (storage, compute, intra-node all-reduce) warns."""
SLOW_FAIL = 0.2
"""Below this share it fails: a node 5x slower than its peers drags every step (or every save) of a job."""
PEAK_WARN = 0.4
"""A GEMM sniff below this share of the GPU type's dense bf16 peak warns (a healthy H100/H200 reaches ~0.6-0.8)."""
HARD_VERSIONS = ("torch", "nccl")
"""Versions that must agree across nodes (collectives of different builds hang or fail); others warn."""
SOFT_VERSIONS = ("cuda", "driver", "meshrun", "python")
EXPECTED_BW_FIELDS = {"intra": ("nvlink_gbytes_s",), "inter": ("ib_gbytes_s",)}
"""Interconnect fields (GB/s) the doctor compares measured bus bandwidth against, when the profile has them."""


@dataclass(frozen=True)
class Options:
    nodes: int
    """Nodes to check."""
    partition: Partition
    """The partition they come from."""
    gpus_per_node: int
    """GPUs asked per node (the partition's unless --gpus-per-node says otherwise; 0: the CPU subset)."""
    data: Optional[str] = None
    """A data path to read, as the ranks see it."""
    storage_mib: int = 64
    """MiB written per storage check."""
    time: str = "00:10:00"
    """The job's time limit."""


def job_spec(profile: ClusterProfile, opts: Options) -> dict[str, Any]:
    """The doctor job as a spec mapping (validated by the normal planner)."""
    tasks = opts.gpus_per_node or 2
    command = [profile.python, "-m", "meshrun.launcher.probes.doctor", "--storage-mib", str(opts.storage_mib)]
    if opts.data:
        command += ["--data", opts.data]
    return {
        "name": "meshrun-doctor",
        "resources": {
            "nodes": opts.nodes,
            "tasks_per_node": tasks,
            "gpus_per_node": opts.gpus_per_node,
            "time": opts.time,
            "partition": opts.partition.name,
        },
        "command": command,
        "checkpoint": {"max_requeues": 0},  # a preflight that failed is the answer, never requeued
        "env": {"OMP_NUM_THREADS": "1"},
    }


def with_exclude(
    profile: ClusterProfile, flags: Sequence[str], reaches_other_machines: Callable[[str], bool]
) -> ClusterProfile:
    """The profile with `submit --exclude n1,n7` (repeatable) added to its own defaults.exclude.
    `reaches_other_machines(scheduler)` (the caller's: api.reaches_other_machines) says whether a scheduler has
    nodes to leave out; it is asked only when names are given (a backend is imported only then)."""
    names = [name.strip() for flag in flags for name in flag.split(",") if name.strip()]
    if not names:
        return profile
    if not reaches_other_machines(profile.scheduler):
        raise InputError(
            "--exclude", names[0], f"the {profile.scheduler} cluster is this one machine: it has no nodes to leave out"
        )
    exclude = check_node_names("--exclude", [*profile.defaults.exclude, *check_node_names("--exclude", names)])
    return replace(profile, defaults=replace(profile.defaults, exclude=exclude))


@dataclass(frozen=True)
class Check:
    name: str
    verdict: Verdict
    text: str
    """A short cell for the table."""
    why: str = ""
    """The full reason, printed under the table for warn and fail."""


@dataclass(frozen=True)
class NodeRow:
    node: str
    checks: tuple[Check, ...]

    @property
    def verdict(self) -> Verdict:
        found = [c.verdict for c in self.checks]
        return max(found, key=lambda v: RANK_ORDER[v]) if found else "fail"


@dataclass(frozen=True)
class Report:
    rows: tuple[NodeRow, ...]
    notes: tuple[str, ...]
    """What was skipped or not compared, and the job-wide figures."""

    @property
    def bad_nodes(self) -> tuple[str, ...]:
        return tuple(r.node for r in self.rows if r.verdict == "fail")


# ------------------------------------------------------------------ grouping


def by_node(results: Sequence[Optional[Mapping[str, Any]]], tasks_per_node: int) -> dict[str, list[Any]]:
    """Each node's ranks' results; a rank that wrote none is placed by Slurm's block order (rank // tasks)."""
    names: dict[int, str] = {}
    for rank, res in enumerate(results):
        if res is not None:
            names.setdefault(rank // tasks_per_node, str(res.get("node")))
    nodes: dict[str, list[Any]] = {}
    for rank, res in enumerate(results):
        index = rank // tasks_per_node
        name = names.get(index, f"node #{index} (no rank reported)")
        nodes.setdefault(name, []).append(res if res is not None else {"rank": rank, "missing": True})
    return nodes


# ------------------------------------------------------------------ checks


def _error(ranks: Sequence[Mapping[str, Any]], key: str) -> Optional[str]:
    for res in ranks:
        part = res.get(key)
        if isinstance(part, dict) and "error" in part:
            return f"rank {res['rank']}: {part['error']}"
    return None


def check_missing(ranks: Sequence[Mapping[str, Any]]) -> Optional[Check]:
    gone = [r["rank"] for r in ranks if r.get("missing")]
    late = [r["rank"] for r in ranks if not r.get("missing") and r.get("phase") != "done"]
    if gone:
        return Check(
            "ranks",
            "fail",
            "no results",
            f"rank(s) {gone} wrote no results: the run dir's logs/rank-{gone[0]}.log says why",
        )
    if late:
        return Check("ranks", "fail", "unfinished", f"rank(s) {late} stopped before the all-reduce finished")
    return None


def majority(values: Sequence[Any]) -> Any:
    return Counter(values).most_common(1)[0][0] if values else None


def check_versions(ranks: Sequence[Mapping[str, Any]], everyone: Mapping[str, Any], login: str) -> Check:
    """This node's versions against the other nodes' most common ones and the login node's meshrun."""
    if (err := _error(ranks, "versions")) is not None:
        return Check("versions", "fail", "error", err)
    mine = ranks[0].get("versions", {})
    problems: list[tuple[Verdict, str]] = []
    for key in (*HARD_VERSIONS, *SOFT_VERSIONS):
        values = {str(r.get("versions", {}).get(key)) for r in ranks}
        if len(values) > 1:
            problems.append(("fail" if key in HARD_VERSIONS else "warn", f"{key} differs between ranks: {values}"))
        elif str(mine.get(key)) != str(everyone.get(key)):
            verdict: Verdict = "fail" if key in HARD_VERSIONS else "warn"
            problems.append((verdict, f"{key} {mine.get(key)} where most nodes run {everyone.get(key)}"))
    if mine.get("meshrun") != login:
        problems.append(("warn", f"meshrun {mine.get('meshrun')} here, {login} where you submit"))
    short = f"torch {mine.get('torch')}" + (f" nccl {mine['nccl']}" if mine.get("nccl") else "")
    if not problems:
        return Check("versions", "pass", short)
    worst = max((v for v, _ in problems), key=lambda v: RANK_ORDER[v])
    return Check("versions", worst, short, "; ".join(text for _, text in problems))


def check_gpus(ranks: Sequence[Mapping[str, Any]], opts: Options) -> Check:
    if opts.gpus_per_node == 0:
        return Check("gpus", "skip", "CPU job")
    if (err := _error(ranks, "gpus")) is not None:
        return Check("gpus", "fail", "error", err)
    blind = [r for r in ranks if not r.get("gpus", {}).get("count")]
    if blind:
        r = blind[0]
        seen = r.get("gpus", {}).get("cuda_visible_devices")
        return Check("gpus", "fail", "none seen", f"rank {r['rank']} sees no CUDA GPU (CUDA_VISIBLE_DEVICES={seen})")
    devices = {d.get("uuid") or d.get("index"): d for r in ranks for d in r["gpus"]["devices"]}
    text = f"{len(devices)} x {majority([d.get('model') for d in devices.values()])}"
    if len(devices) != opts.gpus_per_node:
        why = f"the node's tasks see {len(devices)} distinct GPUs, {opts.gpus_per_node} were asked for"
        return Check("gpus", "fail", text, why)
    part = opts.partition
    wrong = [d for d in devices.values() if part.gpu_type and part.gpu_type.lower() not in str(d.get("model")).lower()]
    if wrong:
        return Check("gpus", "warn", text, f"{wrong[0].get('model')} where the profile says {part.gpu_type}")
    small = [d for d in devices.values() if part.gpu_memory_gb and d.get("memory_gib", 0) < 0.9 * part.gpu_memory_gb]
    if small:
        why = f"{small[0].get('uuid')}: {small[0].get('memory_gib')} GiB, the profile says {part.gpu_memory_gb} GiB"
        return Check("gpus", "warn", text, why)
    return Check("gpus", "pass", text)


def shown(value: float) -> str:
    """A figure as the table prints it: whole from 100 up, else 3 significant figures (1383 and 1435.6 MB/s in
    one row read as different precisions)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def relative(name: str, value: float, best: float, unit: str, what: str) -> Optional[Check]:
    """A figure against the fastest node's: fail below SLOW_FAIL of it, warn below SLOW_WARN."""
    if best <= 0 or value >= SLOW_WARN * best:
        return None
    verdict: Verdict = "fail" if value < SLOW_FAIL * best else "warn"
    why = f"slow: {what} {shown(value)} {unit} is {value / best:.0%} of the fastest node's ({shown(best)} {unit})"
    return Check(name, verdict, f"{shown(value)} {unit}", why)


def check_compute(ranks: Sequence[Mapping[str, Any]], best: float, opts: Options) -> Check:
    if (err := _error(ranks, "compute")) is not None:
        return Check("compute", "fail", "error", err)
    figures = [r["compute"]["tflops"] for r in ranks if "tflops" in r.get("compute", {})]
    if not figures:
        return Check("compute", "skip", "CPU only")
    low = min(figures)
    device = str(ranks[0]["compute"].get("device", ""))
    if device == "cpu":
        # fp32 on each rank's threads, against the other nodes only; like gloo, it only warns. The node's fastest
        # rank is its figure: its ranks share its cores, so one measured while the others ran is slower by
        # scheduling alone (a loaded 2-core machine measured one rank at 40% of the other).
        high = max(figures)
        slow = relative("compute", high, best, "TFLOP/s", "the node's fp32 CPU GEMM")
        if slow:
            return replace(slow, verdict="warn")
        return Check("compute", "pass", f"CPU {high * 1000:.3g} GFLOP/s")
    slow = relative("compute", low, best, "TFLOP/s", "the slowest GPU's bf16 GEMM")
    if slow:
        return slow
    peak = peak_tflops(opts.partition.gpu_type or "") or peak_tflops(device)
    text = f"{shown(low)} TFLOP/s" + (f" ({low / peak:.0%})" if peak else "")
    if peak and low < PEAK_WARN * peak:
        return Check(
            "compute", "warn", text, f"bf16 GEMM {shown(low)} TFLOP/s is {low / peak:.0%} of the {shown(peak)} peak"
        )
    return Check("compute", "pass", text)


STORAGE_LABELS = {"checkpoint": "ckpt write", "scratch": "scratch write", "data": "data read"}


def check_storage(ranks: Sequence[Mapping[str, Any]], best: Mapping[str, float]) -> Check:
    store = next((r["storage"] for r in ranks if "storage" in r), None)
    if store is None:
        return Check("storage", "fail", "not measured", "the node's local rank 0 reported no storage figures")
    if "error" in store:
        return Check("storage", "fail", "error", store["error"])
    cells, worst = [], Check("storage", "pass", "")
    for key, label in STORAGE_LABELS.items():
        part = store.get(key)
        if not part:
            continue
        if "error" in part:
            return Check("storage", "fail", f"{label} error", f"{label} {part['path']}: {part['error']}")
        cells.append(f"{label} {shown(part['mbps'])} MB/s")  # each cell its unit: they are read one by one
        found = relative("storage", part["mbps"], best.get(key, 0), "MB/s", f"{label} of {part['path']}")
        if found and RANK_ORDER[found.verdict] > RANK_ORDER[worst.verdict]:
            worst = found
    return Check("storage", worst.verdict, ", ".join(cells), worst.why)


def expected_bw(interconnect: Interconnect, which: str, opts: Options) -> Optional[float]:
    """The profile's expected bus bandwidth per GPU in GB/s (None: the profile has no such field, or the job
    has no GPUs: gloo on CPUs is not what NCCL gets over NVLink or InfiniBand)."""
    if opts.gpus_per_node == 0:
        return None
    for name in EXPECTED_BW_FIELDS[which]:
        value = getattr(interconnect, name, None)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return None


def check_comm(ranks: Sequence[Mapping[str, Any]], best: float, expected: Optional[float], gpus: int) -> Check:
    if (err := _error(ranks, "comm")) is not None:
        return Check("comm", "fail", "error", err)
    comm: Mapping[str, Any] = next((r["comm"] for r in ranks if "comm" in r), {})
    figure = comm.get("intra_node_busbw_gbps")
    if figure is None:
        return Check("comm", "skip" if comm else "fail", "1 rank" if comm else "not measured")
    slow = relative("comm", figure, best, "GB/s", "intra-node all-reduce bus bandwidth")
    if slow and not gpus:  # gloo between CPU processes swings with the host's load: a hint, not a verdict
        return Check("comm", "warn", slow.text, slow.why)
    if slow:
        return slow
    text = f"{shown(figure)} GB/s {comm.get('backend')}"
    if expected and figure < SLOW_WARN * expected:
        why = (
            f"intra-node bus bandwidth {shown(figure)} GB/s, the profile's interconnect should give ~{shown(expected)}"
        )
        return Check("comm", "warn", text, why)
    return Check("comm", "pass", text)


def check_health(ranks: Sequence[Mapping[str, Any]]) -> Check:
    """The health gate's checks (launcher/probes/health.py), as each node's local rank 0 ran them."""
    found = next((r["health"] for r in ranks if "health" in r), None)
    if found is None:  # an older meshrun on the node (a rank that wrote nothing fails as "ranks")
        return Check("health", "skip", "not run")
    if isinstance(found, dict):  # {"error": ...}: the checks themselves broke
        return Check("health", "fail", "error", str(found.get("error")))
    failed = [c for c in found if c.get("verdict") == "fail"]
    if failed:
        why = "; ".join(f"{c.get('name')}: {c.get('evidence')}" for c in failed)
        return Check("health", "fail", ", ".join(str(c.get("name")) for c in failed), why)
    return Check("health", "pass", f"{sum(c.get('verdict') == 'pass' for c in found)} checks")


# ------------------------------------------------------------------ the report


def _best(nodes: Mapping[str, Sequence[Mapping[str, Any]]], pick: Any) -> float:
    values = [v for ranks in nodes.values() for r in ranks if (v := pick(r)) is not None]
    return max(values, default=0.0)


def judge(
    results: Sequence[Optional[Mapping[str, Any]]],
    opts: Options,
    profile: ClusterProfile,
    login_meshrun: str,
) -> Report:
    """One row per node from every rank's results (None: the rank wrote none)."""
    nodes = by_node(results, opts.gpus_per_node or 2)
    present = [r for ranks in nodes.values() for r in ranks if not r.get("missing")]
    everyone = {
        k: majority([str(r.get("versions", {}).get(k)) for r in present]) for k in (*HARD_VERSIONS, *SOFT_VERSIONS)
    }
    best_compute = _best(nodes, lambda r: r.get("compute", {}).get("tflops"))
    best_comm = _best(nodes, lambda r: (r.get("comm") or {}).get("intra_node_busbw_gbps"))
    best_store = {
        key: _best(nodes, lambda r, k=key: ((r.get("storage") or {}).get(k) or {}).get("mbps"))
        for key in STORAGE_LABELS
    }
    intra = expected_bw(profile.interconnect, "intra", opts)
    rows = []
    for node, ranks in nodes.items():
        got = [r for r in ranks if not r.get("missing")]
        missing = check_missing(ranks)
        checks = [missing] if missing else []
        if got:
            checks += [
                check_versions(got, everyone, login_meshrun),
                check_gpus(got, opts),
                check_comm(got, best_comm, intra, opts.gpus_per_node),
                check_compute(got, best_compute, opts),
                check_storage(got, best_store),
                check_health(got),
            ]
        rows.append(NodeRow(node, tuple(checks)))
    return Report(tuple(rows), tuple(notes(present, opts, profile)))


def notes(present: Sequence[Mapping[str, Any]], opts: Options, profile: ClusterProfile) -> list[str]:
    out = []
    if opts.gpus_per_node == 0:
        out.append("CPU job: skipped GPUs and NCCL; the GEMM ran in fp32 on the CPU, the all-reduce over gloo")
    inter = [r["comm"]["inter_node_busbw_gbps"] for r in present if "inter_node_busbw_gbps" in (r.get("comm") or {})]
    expected = expected_bw(profile.interconnect, "inter", opts)
    if inter:
        line = f"across {opts.nodes} nodes: all-reduce bus bandwidth {shown(min(inter))} GB/s"
        if expected:
            line += f" (the profile's interconnect should give ~{shown(expected)} GB/s)"
            if min(inter) < SLOW_WARN * expected:
                line = "WARN " + line
        out.append(line)
    elif opts.nodes == 1:
        out.append("one node: no across-node all-reduce (ask for --nodes 2 or more)")
    if opts.gpus_per_node == 0:
        out.append("bandwidth not compared with the profile's interconnect: gloo on CPUs is not what NCCL gets")
    elif expected_bw(profile.interconnect, "intra", opts) is None and expected is None:
        out.append("bandwidth not compared with the profile: its interconnect names no expected bandwidth")
    return out


def table(report: Report) -> str:
    """The pass/warn/fail table, the reasons, the bad nodes and the --exclude to add."""
    names = ("versions", "gpus", "comm", "compute", "storage", "health")
    rows = [("NODE", *(n.upper() for n in names), "RESULT")]
    for row in report.rows:
        cells = {c.name: c for c in row.checks}
        line = [row.node]
        for name in names:
            c = cells.get(name) or (cells.get("ranks") if name == "versions" else None)
            line.append(f"{c.verdict.upper() if c.verdict != 'pass' else 'ok'} {c.text}".strip() if c else "-")
        rows.append((*line, row.verdict.upper()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    for row in report.rows:
        out += [f"{row.node}: {c.verdict.upper()} {c.name}: {c.why}" for c in row.checks if c.why]
    out += list(report.notes)
    if report.bad_nodes:
        out.append(f"bad nodes: {compress(report.bad_nodes)}")
        out.append(f"add to submit: --exclude {','.join(report.bad_nodes)}")
    else:
        out.append("no bad nodes")
    return "\n".join(out) + "\n"
