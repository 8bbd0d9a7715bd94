"""`meshrun plan SPEC -c CLUSTER [--set ...] [--json]`: will it fit, how fast, and with which layout.

Pure: reads the spec and the profile, touches no cluster. The numbers come from submit/planning/estimate.py (memory,
step time) and submit/planning/recommend.py (the layout search); docs/guides/plan-and-doctor.md states the model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from meshrun.submit.cli.args import cluster_arg, overrides_arg
from meshrun.submit.errors import InputError


def add_parsers(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = verbs.add_parser(
        "plan", help="memory per GPU, fit, step time and the recommended layout of a job; submits nothing"
    )
    p.add_argument("spec", type=Path, help="job spec YAML (see examples/)")
    cluster_arg(p)
    overrides_arg(p, "override a spec key, e.g. --set train.model.preset=llama-70b (repeatable)")
    p.add_argument(
        "--json", action="store_true", help="print the plan as JSON (stable keys: docs/guides/plan-and-doctor.md)"
    )
    p.add_argument(
        "--mesh",
        action="store_true",
        help="also count each rank's model-state bytes on the real model, split by the real parallel code in a "
        "fake world of the job's size (needs torch here; seconds for thousands of ranks)",
    )


GIB = 2**30


def _size(n: float) -> str:
    """GiB, or MiB below a tenth of one (a small job's parts all read 0.0 GiB otherwise)."""
    from meshrun.submit.planning.estimate import gib

    return gib(n) if n >= GIB / 10 or n == 0 else f"{n / 2**20:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _choice_json(choice: Any, spec: Any) -> Optional[dict[str, Any]]:
    if choice is None:
        return None
    out: dict[str, Any] = dict(choice.layout)
    out["set"] = choice.overrides(spec)
    out["memory_per_gpu_bytes"] = choice.memory.as_json()
    if choice.time is not None:
        out.update(step_time_s=choice.time.step_s, tokens_per_s=choice.time.tokens_per_s, mfu=choice.time.mfu)
    return out


def _usable(partition: Any) -> Optional[int]:
    """The partition's GPU memory less the headroom; None where it is unknown (a CPU partition, an unknown GPU)."""
    from meshrun.submit.planning import estimate, recommend

    memory = recommend.gpu_memory(partition) if partition is not None and partition.gpus_per_node else None
    return estimate.usable_bytes(memory) if memory else None


def build(spec: Any, cluster: Any, partition: Any) -> dict[str, Any]:
    """The plan's JSON object (docs/guides/plan-and-doctor.md documents every key). Where `meshrun doctor`
    measured a partition (submit/planning/calibration.py), its figures time the job instead of the datasheet's."""
    from meshrun.launcher.contract.spec.modelshape import param_count
    from meshrun.submit.planning import calibration, estimate, recommend, steptime

    memory = estimate.memory_per_gpu(spec)
    measured = calibration.load_all(cluster.name)
    hw = recommend.job_hardware(spec, cluster, partition, measured) if partition is not None else None
    time = steptime.step_time(spec, hw) if hw is not None else None
    fits = {
        p.name: estimate.fits(memory, recommend.gpu_memory(p)) if p.gpus_per_node else None for p in cluster.partitions
    }
    recommended = None
    if partition is not None and partition.gpus_per_node:
        found = recommend.best(spec, cluster, partition, spec.resources.nodes, measured.get(partition.name))
        recommended = _choice_json(
            found or recommend.smallest(spec, cluster, partition, measured.get(partition.name)), spec
        )
    table = []
    for part in cluster.partitions:
        if not part.gpus_per_node:
            continue
        choice = recommend.smallest(spec, cluster, part, measured.get(part.name))
        row = {"partition": part.name, "gpu_type": part.gpu_type, "gpu_memory_gb": recommend.gpu_memory(part)}
        if choice is not None:
            row.update(gpus=choice.spec.world_size, recommended=_choice_json(choice, spec))
        table.append(row)
    t = spec.trainer
    return {
        "cluster": cluster.name,
        "params": param_count(t.model),
        "memory_per_gpu_bytes": memory.as_json(),
        "stage": memory.stage,
        "partition": partition.name if partition is not None else None,
        "usable_bytes": _usable(partition),
        "fits": fits.get(partition.name) if partition is not None else None,
        "fits_by_partition": fits,
        "flops_per_step": time.flops_per_step if time else steptime.flops_per_step(spec),
        "step_time_s": time.step_s if time else None,
        "tokens_per_s": time.tokens_per_s if time else None,
        "mfu": time.mfu if time else None,
        "time": time.as_json() if time else None,
        "figures": hw.source if hw is not None else None,
        **steptime.run_estimate(spec, cluster.cost, time.step_s if time else None),
        "recommended": recommended,
        "partitions": table,
    }


def _layout_text(layout: dict[str, Any]) -> str:
    mode = f"zero {layout['zero']}" if "zero" in layout else layout["dp_mode"]
    return (
        f"{layout['nodes']} node(s): dp {layout['dp']} tp {layout['tp']} pp {layout['pp']} {mode}, micro_batch "
        f"{layout['micro_batch']} x {layout['accumulation']}, checkpointing "
        f"{'on' if layout['activation_checkpointing'] else 'off'}"
    )


def _speed(obj: dict[str, Any]) -> str:
    if obj.get("tokens_per_s") is None:
        return "time unknown (no peak for this GPU type in launcher/contract/gpus.py)"
    return f"{obj['step_time_s']:.3g} s/step, {obj['tokens_per_s']:,.0f} tokens/s, MFU {obj['mfu']:.0%}"


def render(out: dict[str, Any], spec: Any) -> str:
    """The plan for a person."""
    from meshrun.submit.planning.estimate import CONTEXT_BYTES, FRAGMENTATION, HEADROOM
    from meshrun.submit.planning.estimate import gib as _gib
    from meshrun.submit.views.tables import table

    m, t, p, res = spec.trainer.model, spec.trainer, spec.parallel, spec.resources
    on_cpu = not res.gpus_per_node  # ranks on CPU cores: the estimate is of each rank's host memory
    kv = f" ({m.kv_heads} kv)" if m.kv_heads != m.n_heads else ""
    tied = ", tied head" if m.tie_embeddings else ""
    where = f"{res.tasks_per_node} CPU ranks" if on_cpu else f"{res.gpus_per_node} GPUs"
    lines = [
        f"model: {_count(out['params'])} parameters (n_layers {m.n_layers}, d_model {m.d_model}, n_heads "
        f"{m.n_heads}{kv}, vocab {m.vocab_size}{tied}, seq_len {m.seq_len}), {out['flops_per_step']:.3g} FLOPs "
        "per step",
        f"layout: {res.nodes} node(s) x {where}: dp {p.dp} tp {p.tp} pp "
        f"{p.pp}, micro_batch {t.micro_batch}, global_batch {t.global_batch}, {t.precision}, engine {t.engine}",
        f"memory per {'rank (host memory; ' if on_cpu else 'GPU ('}stage {out['stage']}, the largest):",
    ]
    mem = out["memory_per_gpu_bytes"]
    for key in ("params", "grads", "optimizer", "activations", "allowance", "total"):
        lines.append(f"  {key:<12}{_size(mem[key]):>12}")
    runtime = "runtime" if on_cpu else "context"
    lines[-2] += f"   ({_gib(CONTEXT_BYTES)} {runtime} + working copies + {FRAGMENTATION:.0%} fragmentation)"
    if mem["cpu"]:
        lines.append(f"  offloaded to CPU memory: {_gib(mem['cpu'])}")
    if out["fits"] is not None:
        verdict = "fits" if out["fits"] else "does NOT fit"
        lines.append(
            f"  {verdict} partition {out['partition']!r}: {_gib(out['usable_bytes'])} usable ({HEADROOM:.0%} headroom)"
        )
    if on_cpu and not out["time"]:
        lines.append(
            f"time: not estimated for CPU ranks until `meshrun doctor -c {out['cluster']} --gpus-per-node 0` has "
            "measured this cluster's CPUs"
        )
    if out["time"]:
        tm = out["time"]
        # CPU ranks: the blocks' work besides their matmuls, and (a node with more ranks than CPUs) the CPUs' bound
        blocks = f", blocks {tm['layers_s']:.3g} s" if tm.get("layers_s") else ""
        crowded = tm.get("cpu_bound_s") and tm["cpu_bound_s"] >= tm["step_s"]
        bound = f"; bound by the node's CPUs: {tm['cpu_bound_s']:.3g} s" if crowded else ""
        lines.append(
            f"time: {_speed(out)} (compute {tm['compute_s']:.3g} s{blocks}, bubble {tm['bubble']:.0%}, tp "
            f"{tm['tp_comm_s']:.3g} s, pp {tm['pp_comm_s']:.3g} s, dp {tm['dp_comm_s']:.3g} s "
            f"{'overlapped' if tm['dp_overlapped'] else 'in series'}, optimizer {tm['optimizer_s']:.3g} s{bound})"
            f"; {out['figures']}"
        )
    if out["run_s"] is not None:
        lines.append(_run_line(out, spec))
    rec = out["recommended"]
    if rec is not None:
        lines.append(f"recommended on {out['partition']!r}: {_layout_text(rec)}; {_speed(rec)}")
        lines.append("  " + (" ".join(f"--set {item}" for item in rec["set"]) or "(the spec's own layout)"))
    text = "\n".join(lines) + "\n"
    rows = [("PARTITION", "GPU", "GiB", "FITS AS IS", "FEWEST GPUS", "LAYOUT", "TOKENS/S", "MFU")]
    for row in out["partitions"]:
        best = row.get("recommended")
        fits = out["fits_by_partition"].get(row["partition"])
        rows.append(
            (
                row["partition"],
                str(row["gpu_type"] or "-"),
                f"{row['gpu_memory_gb']:g}" if row["gpu_memory_gb"] else "?",
                "-" if fits is None else ("yes" if fits else "no"),
                str(row.get("gpus", "none fit" if row["gpu_memory_gb"] else "?")),
                _layout_text(best) if best else "-",
                f"{best['tokens_per_s']:,.0f}" if best and best.get("tokens_per_s") else "-",
                f"{best['mfu']:.0%}" if best and best.get("mfu") else "-",
            )
        )
    return text + (table(rows) if len(rows) > 1 else "")


def _run_line(out: dict[str, Any], spec: Any) -> str:
    from meshrun.submit.views.tables import span

    res = spec.resources
    line = f"run: {spec.trainer.steps} steps in {span(out['run_s'])}"
    if not res.gpus_per_node:
        return line + " on CPU ranks (no GPU-hours)"
    line += f" on {res.nodes * res.gpus_per_node} GPUs: {out['gpu_hours']:.3g} GPU-hours"
    cost = out["cost"]
    if cost is None:
        return line + f" (add cost.gpu_hour to the {out['cluster']} profile to price it)"
    return line + f", {cost['amount']:,.2f} {cost['currency']} at the profile's cost.gpu_hour"


def cmd_plan(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.planning.plan import REMOTE_HOME

    profile = api.load_cluster(args.cluster)
    plan = api.plan_job(args.spec, profile, args.overrides, home=REMOTE_HOME)  # the same checks as submit
    if plan.spec.command is not None:
        raise InputError(
            "command",
            list(plan.spec.command),
            "plan estimates the built-in trainer (train:); a command job's memory is its own program's",
        )
    out = build(plan.spec, profile, plan.partition)
    if args.mesh:
        from meshrun.submit.planning import meshcheck

        out["mesh"] = meshcheck.summary(plan.spec)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(render(out, plan.spec), end="")
        if args.mesh:
            print("\n".join(meshcheck.lines(out["mesh"])))
    return 0
