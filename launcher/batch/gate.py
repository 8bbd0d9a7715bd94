"""The health gate's verdict, on the batch host, before the ranks start. Torch-free, stdlib only.

    python -m meshrun.launcher.batch.gate RUN_DIR

After every node of the allocation answered launcher/probes/health.py (or ran out of time), the batch script
asks this module what to do and gets one line on stdout, `ACTION [NODES]`; what it found goes to stderr (the
batch log):
- `start [NODES]`: every node passed, or the job has spare nodes enough to leave NODES (the failing ones,
  recorded as suspects) out: the ranks start on the others.
- `requeue NODES`: nodes failed (and no spare is left to take their place). Each is recorded in the cluster's
  ledger of suspect nodes (with the failing check as its evidence: `meshrun nodes`) and the job ends its run with
  EXIT_UNHEALTHY, which meshrun.launcher.batch.requeue requeues (it counts as a restart); NODES become the requeued job's
  ExcNodeList: the job's excluded nodes with what a rank failure's requeue leaves out too (meshrun.launcher.batch.leaving's
  `leave_out`: the failing nodes, those spare nodes replaced earlier in the allocation, the ledger's suspects).
  A job with spares asks for fewer nodes (down to resources.nodes) when the partition cannot spare those beside
  nodes + spares: the verdict's `nodes`, which meshrun.launcher.batch.requeue passes on as `nodes N`. Slurm changes both only
  on a pending job: the batch script sets them right after `scontrol requeue`, before it can be scheduled.
- `stop`: nodes failed, and excluding them would leave the partition too few nodes for the job: the job
  ends with EXIT_UNHEALTHY and the reason in `meshrun status` (clear the node, or ask the admins).
RUN_DIR/health.json holds the verdict (`meshrun.launcher.batch.requeue` reads its action and its `nodes`).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from meshrun.launcher.batch.leaving import LEFT_OUT_ENV, Leaving, Runner, fitting, leave_out, run_slurm
from meshrun.launcher.contract.nodelist import compress
from meshrun.launcher.contract.private import append_line
from meshrun.launcher.contract.records import alerts, suspects
from meshrun.launcher.contract.records.rundir import RunDir, job_of, read_state, write_json
from meshrun.launcher.contract.spec.job import read_run_spec
from meshrun.launcher.rank.hostlist import expand_hostlist


@dataclass(frozen=True)
class Verdict:
    action: str
    """start, requeue or stop."""
    failing: Mapping[str, str]
    """Each failing node's evidence: its failed checks, one clause each."""
    excluded: tuple[str, ...] = ()
    """The job's excluded nodes after this verdict."""
    why: str = ""
    """One sentence for the batch log and `meshrun status`."""
    nodes: int = 0
    """How many nodes the requeued job asks for when fewer than the allocation's (its spares given up); 0: as many."""


def failures(
    nodes: Sequence[str], answers: Mapping[str, Optional[Mapping[str, Any]]], timeout_s: float
) -> dict[str, str]:
    """Each node that failed its check, with the evidence: a node without an answer failed too."""
    failing: dict[str, str] = {}
    for node in nodes:
        answer = answers.get(node)
        if answer is None:
            failing[node] = f"no answer within {timeout_s:g} s (the node is down, or cannot run Python)"
            continue
        bad = [c for c in answer.get("checks") or [] if isinstance(c, dict) and c.get("verdict") == "fail"]
        if bad:
            failing[node] = "; ".join(f"{c.get('name')}: {c.get('evidence')}" for c in bad)
    return failing


def exclusion(
    failing: Mapping[str, str],
    excluded: Sequence[str],
    partition_nodes: Sequence[str],
    nodes_needed: int,
    cluster: str = "CLUSTER",
    job: str = "JOB",
) -> Verdict:
    """What to do with failing nodes of a job that leaves out nothing else: exclude them and requeue, unless that
    leaves the partition too few nodes."""
    if not failing:
        return Verdict("start", {})
    return verdict_for(failing, fitting(failing, excluded, partition_nodes, nodes_needed, nodes_needed), cluster, job)


def verdict_for(failing: Mapping[str, str], leaving: Leaving, cluster: str = "CLUSTER", job: str = "JOB") -> Verdict:
    """The gate's requeue or stop, from what the requeued job would leave out (meshrun.launcher.batch.leaving.leave_out: the
    decision a rank failure's requeue makes too)."""
    named = ", ".join(f"{node} ({why})" for node, why in sorted(failing.items()))
    if not leaving.fits:
        nodes = " ".join(f"--clear {node}" for node in sorted(failing))
        why = (
            f"health check failed on {named}; excluding {compress(leaving.excluded)} would leave the partition "
            f"{leaving.room} of the {leaving.least} nodes the job needs: not requeueing (`meshrun nodes -c {cluster} "
            f"{nodes}` once repaired, then `meshrun resume {job}`)"
        )
        return Verdict("stop", dict(failing), leaving.before, why)
    # The nodes it leaves out beside the failing ones: those spares replaced earlier, the ledger's suspects.
    others = [f"{n}: {leaving.reasons[n]}" for n in leaving.excluded if n in leaving.reasons and n not in failing]
    also = f" ({'; '.join(others)})" if others else ""
    why = (
        f"health check failed on {named}: requeueing with {compress(leaving.excluded)} excluded{also}{leaving.fewer()}"
    )
    fewer = leaving.nodes if leaving.nodes < leaving.asked else 0
    return Verdict("requeue", dict(failing), leaving.excluded, why, fewer)


def read_answers(run_dir: str, nodes: Sequence[str]) -> dict[str, Optional[Mapping[str, Any]]]:
    answers: dict[str, Optional[Mapping[str, Any]]] = {}
    for node in nodes:
        answer = read_state(RunDir(run_dir).health_result(node))
        answers[node] = answer if answer.get("node") == node else None
    return answers


def judge(run_dir: str, environ: Mapping[str, str], run: Runner = run_slurm, now: Optional[float] = None) -> Verdict:
    """The gate: read the answers, record failing nodes as suspects, exclude them (module docstring)."""
    spec = read_run_spec_quietly(run_dir)
    allocated = expand_hostlist(environ.get("SLURM_JOB_NODELIST", ""))
    left_out = set(environ.get(LEFT_OUT_ENV, "").split())
    nodes = [n for n in allocated if n not in left_out]  # a node left out earlier in the allocation is not asked
    timeout_s = spec.job.resilience.health_timeout_s if spec else 0.0
    answers = read_answers(run_dir, nodes)
    failing = failures(nodes, answers, timeout_s)
    if not failing:
        slowest = max((float(a.get("seconds") or 0) for a in answers.values() if a), default=0.0)
        counted = f"{len(nodes)} node" + ("s" if len(nodes) != 1 else "")
        return Verdict("start", {}, why=f"health check passed on {counted} (the slowest took {slowest:.1f} s)")
    job = job_of(environ) or "?"
    ledger = spec.run.suspects_file if spec else ""
    for node, evidence in sorted(failing.items()):
        if ledger:
            try:
                append_line(ledger, suspects.finding_line(node, f"health check: {evidence}", job, now))
            except OSError as exc:
                print(f"[meshrun] health: cannot record {node} in {ledger}: {exc}", file=sys.stderr)
    needed = spec.job.resources.nodes if spec else len(allocated)
    if len(nodes) - len(failing) >= needed:  # spare nodes take their place: no requeue
        named = ", ".join(f"{node} ({why})" for node, why in sorted(failing.items()))
        run_on = [node for node in nodes if node not in failing][:needed]  # as the batch script picks them
        why = (
            f"health check failed on {named}: the ranks start on {compress(run_on)} instead (spare nodes in its place)"
        )
        return Verdict("start", dict(failing), tuple(sorted(failing)), why)
    # The requeue leaves out what a rank failure's would (meshrun.launcher.batch.leaving.leave_out): the failing nodes, the nodes
    # spares replaced earlier in this allocation and the ledger's suspects, asking for fewer nodes (its spares given
    # up) when the partition cannot spare them beside nodes + spares.
    blamed = {node: f"health check: {evidence}" for node, evidence in failing.items()}
    cluster = spec.run.cluster if spec else "CLUSTER"
    leaving = leave_out(spec, blamed, environ, run, now)
    if leaving is None:  # never: the failing nodes are there to leave out
        return exclusion(failing, [], [], len(allocated), cluster, job)
    return verdict_for(failing, leaving, cluster, job)


def read_run_spec_quietly(run_dir: str) -> Any:
    """The run's spec, or None when it cannot be read (the gate still judges the answers)."""
    try:
        return read_run_spec(Path(run_dir))
    except Exception:  # no spec to read: the gate still judges the answers
        return None


def main(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> int:
    if len(argv) != 1:
        print("usage: python -m meshrun.launcher.batch.gate RUN_DIR", file=sys.stderr)
        return 2
    run_dir = argv[0]
    verdict = judge(run_dir, environ)
    record = {
        "time": time.time(),
        "job": job_of(environ),
        "action": verdict.action,
        "failing": dict(verdict.failing),
        "excluded": list(verdict.excluded),
        "nodes": verdict.nodes,
        "why": verdict.why,
    }
    write_json(RunDir(run_dir).health_verdict, record, indent=1)
    if verdict.failing:  # status's ALERTS, `watch --notify`: the node and what is done about it
        failed = sorted(verdict.failing)
        node = failed[0] if len(failed) == 1 else None
        alert = alerts.Alert("node_unhealthy", float(len(failed)), None, verdict.why, node=node, job=record["job"])
        alerts.append(RunDir(run_dir).alerts, [alert])
    if verdict.action != "stop":  # a stop's sentence is the requeue policy's reason: the batch log has it once
        print(f"[meshrun] {verdict.why}", file=sys.stderr, flush=True)
    print(verdict.action, ",".join(verdict.excluded) if verdict.action != "stop" else "", flush=True)
    return 0


def verdict_of(run_dir: str) -> dict[str, Any]:
    """The latest start's gate verdict ({} when there was none)."""
    return read_state(RunDir(run_dir).health_verdict)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
