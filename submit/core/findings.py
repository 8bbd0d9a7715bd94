"""What the sidecars found, as `meshrun status` shows it: a hang's verdict, stragglers, environment mismatches.

The sidecars write RUN_DIR/diagnosis/verdict.json (and verdict.txt), RUN_DIR/stragglers.json and
RUN_DIR/env/NODE.json. Every one is optional and may be half-written or garbled: each is read
size-capped and parsed here, and whatever does not parse is left out, never raised.

Over SSH the files of every job come back in the status round trip the backend already makes:
`findings_argv` is ONE command for all jobs (a constant script; every path a positional parameter),
and `split_findings` takes its output apart again. On this machine `read_files` reads the same files.
"""

from __future__ import annotations

import json
import math
import posixpath
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from meshrun.launcher.contract.records import energy
from meshrun.launcher.contract.records.envcheck import env_mismatches, newest_run, parse_record
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec import dsconfig
from meshrun.submit.core.usage import usage

CAP_BYTES = 65536
"""Read at most this much of each file: a status of many jobs stays small whatever a sidecar wrote."""
SLACK_S = 300.0
"""Clock difference allowed between this machine and the cluster when deciding a finding's age."""

_HERE = RunDir("")
VERDICT_JSON = _HERE.verdict_json
VERDICT_TXT = _HERE.verdict
STRAGGLERS = _HERE.stragglers
ENV_DIR = _HERE.path(RunDir.ENV)

ALERTS = _HERE.alerts
GPU_METRICS = _HERE.gpu_metrics
SPEC = RunDir.SPEC
LAST_CHECKPOINT = _HERE.last_checkpoint
GOODPUT_DIR = posixpath.dirname(_HERE.goodput("JOB"))
ENERGY_DIR = posixpath.dirname(_HERE.energy("JOB", "NODE"))
TAIL_BYTES = 16384
"""Of the appended files (alerts.jsonl, gpu.jsonl) only the newest TAIL_BYTES come back: the newest lines."""
ALERTS_KEPT = 50
"""A status keeps a job's newest ALERTS_KEPT alerts."""

# $1 marker, $2 cap, $3 verdict.json, $4 verdict.txt, $5 stragglers.json, $6 env dir ("": skip),
# $7 alerts.jsonl, $8 gpu.jsonl ("": skip), $9 the tail cap, $10 spec.json ("": skip), $11 the last checkpoint's
# record, $12 the goodput dir ("": skip), $13 the energy dir ("": skip), then the run dirs. The first files are read from their start (head), the appended ones from their
# end (tail): their newest lines.
FINDINGS_SCRIPT = (
    "m=$1; cap=$2; v=$3; t=$4; s=$5; e=$6; a=$7; g=$8; tc=$9; sp=${10}; lc=${11}; gp=${12}; en=${13}; shift 13; "
    'for d in "$@"; do printf "\\n%s run\\n" "$m"; '
    'for f in "$d/$v" "$d/$t" "$d/$s" "$d/$lc" ${e:+"$d/$e"/*.json} ${sp:+"$d/$sp"} ${gp:+"$d/$gp"/*.json} ${en:+"$d/$en"/*.json}; do [ -f "$f" ] || continue; '
    'printf "\\n%s file %s\\n" "$m" "${f#"$d"/}"; head -c "$cap" -- "$f"; done; '
    'for f in "$d/$a" ${g:+"$d/$g"}; do [ -f "$f" ] || continue; '
    'printf "\\n%s file %s\\n" "$m" "${f#"$d"/}"; tail -c "$tc" -- "$f"; done; done; exit 0'
)


@dataclass(frozen=True)
class Findings:
    """The sidecars' findings for one job (all empty: nothing found, or nothing readable)."""

    verdict: Optional[dict[str, Any]] = None
    """The hang's verdict.json (its "verdict" paragraph always a string), None when no hang was diagnosed."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """[{"rank", "node", "busy_s", "ratio"}] from stragglers.json."""
    env_mismatches: list[str] = field(default_factory=list)
    """One line per version that differs between the newest run's nodes."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """This job's newest alert records (launcher/contract/records/alerts.py), oldest first."""
    gpus: list[dict[str, Any]] = field(default_factory=list)
    """The newest gpu.jsonl sample of each GPU (asked for by `meshrun top` only; else [])."""
    steps: Optional[int] = None
    """The trainer's train.steps from spec.json (one job's detail view and `meshrun top`; None for a command job)."""
    engine: Optional[str] = None
    """The engine from spec.json, e.g. 'deepspeed ZeRO-2, optimizer offload' (as `steps`)."""
    goodput: Optional[dict[str, Any]] = None
    """Where this job's allocated time went, as of its newest attempt's start or end or its sidecar's last
    minute (one job's detail view and `top`): RUN_DIR/.meshrun/goodput/JOB.json, launcher/contract/records/goodput.py."""
    run_goodput: Optional[dict[str, Any]] = None
    """The run dir's total over every job in it (a resume in the run dir is a job of its own), when it has more
    than one: {"jobs", "allocated_s", "productive_s", "lost_steps", "effective_pct"}."""
    checkpoint_step: Optional[int] = None
    """This job's newest checkpoint complete on shared storage (RunDir.last_checkpoint), None when it made none
    (or a later job of the run dir made the newest: then its own metrics events say)."""
    energy: Optional[dict[str, Any]] = None
    """What the job's nodes measured of its energy (launcher/contract/records/energy.py's total; one job's detail view and
    `top`); None when no node recorded any."""
    spec_gpus: Optional[int] = None
    """The GPUs spec.json asks for (nodes x gpus_per_node; with spec.json only, as `steps`)."""
    price: tuple[float, str] = (0.0, "")
    """spec.json's GPU-hour price and currency (0: not priced)."""

    def usage(self, elapsed_s: Optional[float], allocated_gpus: Optional[int]) -> Optional[dict[str, Any]]:
        """What the job used (submit/core/usage.py), where spec.json or an energy record came back: the GPUs
        Slurm's accounting names (else the spec's) over the goodput record's allocated time (else `elapsed_s`)."""
        if self.spec_gpus is None and self.energy is None:
            return None
        gpus = allocated_gpus if allocated_gpus is not None else self.spec_gpus
        allocated = _number((self.goodput or {}).get("allocated_s"))
        run = _number((self.run_goodput or {}).get("allocated_s"))
        return usage(gpus, allocated if allocated is not None else elapsed_s, run, self.energy, *self.price)

    def progress(self, progress: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics tail's progress, raised to what the job's records say: the checkpoint RunDir.last_checkpoint
        names (the tail's checkpoint events can be further back than it reaches: a long checkpoint interval, or
        absent: a command job's), and the step and checkpoint of its goodput record (written at its end from the
        whole metrics file: once a resume in the same run dir has filled the tail, an ended job's own lines are
        gone from it, and what it showed must not change). Each only ever raises a figure."""
        merged = dict(progress)
        recorded = (self.goodput or {}).get("progress")
        for key, value in (
            *((recorded or {}).items() if isinstance(recorded, dict) else ()),
            ("checkpoint_step", self.checkpoint_step),
        ):
            if key not in ("step", "checkpoint_step") or not isinstance(value, int) or isinstance(value, bool):
                continue
            known = merged.get(key)
            merged[key] = value if not isinstance(known, int) else max(known, value)
        return merged

    def status_fields(self) -> dict[str, Any]:
        """The Status fields these fill, for every backend's status builder alike."""
        return {
            "verdict": self.verdict,
            "stragglers": self.stragglers,
            "env_mismatches": self.env_mismatches,
            "alerts": self.alerts,
            "gpus": self.gpus,
            "steps": self.steps,
            "engine": self.engine,
            "goodput": self.goodput,
            "run_goodput": self.run_goodput,
            "restarts_in_job": sum(1 for a in (self.goodput or {}).get("attempts") or () if a.get("in_job")),
        }


NOTHING = Findings()


def findings_argv(run_dirs: Sequence[str], with_env: bool, marker: str, with_gpus: bool = False) -> list[str]:
    """One command printing every job's finding files, each after a line naming it. spec.json (steps, engine)
    comes with the detail view (`with_env`) and `top` (`with_gpus`) only: a long list needs neither. The goodput
    records come with every view: the list's RESTARTS counts the restarts inside an allocation from them."""
    env = ENV_DIR if with_env else ""
    gpus = GPU_METRICS if with_gpus else ""
    spec = SPEC if with_env or with_gpus else ""
    caps = (str(CAP_BYTES), VERDICT_JSON, VERDICT_TXT, STRAGGLERS, env, ALERTS, gpus, str(TAIL_BYTES), spec)
    energy = ENERGY_DIR if with_env or with_gpus else ""
    return ["sh", "-c", FINDINGS_SCRIPT, "sh", marker, *caps, LAST_CHECKPOINT, GOODPUT_DIR, energy, *run_dirs]


def split_findings(output: str, jobs: int, marker: str) -> list[dict[str, str]]:
    """`findings_argv`'s output -> per job, {path relative to the run dir: text}; {} for jobs it lacks."""
    found: list[dict[str, str]] = []
    for chunk in output.split(f"\n{marker} run\n")[1 : jobs + 1]:
        files: dict[str, str] = {}
        for part in chunk.split(f"\n{marker} file ")[1:]:
            name, _, text = part.partition("\n")
            files[name] = text
        found.append(files)
    return found + [{} for _ in range(jobs - len(found))]


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as handle:
            return handle.read(CAP_BYTES).decode(errors="replace")
    except OSError:
        return None


def _tail(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - TAIL_BYTES))
            return handle.read(TAIL_BYTES).decode(errors="replace")
    except OSError:
        return None


def read_files(run_dir: str, with_env: bool, with_gpus: bool = False) -> dict[str, str]:
    """The same files as `findings_argv`, read on this machine (the local cluster)."""
    import os

    root = RunDir(run_dir)
    tails = {name: _tail(root.path(name)) for name in (ALERTS, *(GPU_METRICS,) * with_gpus)}
    names = [VERDICT_JSON, VERDICT_TXT, STRAGGLERS, LAST_CHECKPOINT, *(SPEC,) * (with_env or with_gpus)]
    for folder in (*(ENV_DIR,) * with_env, GOODPUT_DIR, *(ENERGY_DIR,) * (with_env or with_gpus)):
        try:
            listed = sorted(os.listdir(root.path(folder)))
        except OSError:
            listed = []
        names += [posixpath.join(folder, n) for n in listed if n.endswith(".json") and not n.startswith(".")]
    found = {**{name: _read(root.path(name)) for name in names}, **tails}
    return {name: text for name, text in found.items() if text is not None}


def _json_object(text: Optional[str]) -> dict[str, Any]:
    try:
        value = json.loads(text or "")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _recent(found: Mapping[str, Any], submitted_at: float) -> bool:
    """From this job, not from an earlier job of the same run dir (a resume starts a new job there)."""
    when = _number(found.get("time"))
    return when is None or when >= submitted_at - SLACK_S


def parse_verdict(data_text: Optional[str], paragraph: Optional[str]) -> Optional[dict[str, Any]]:
    """verdict.json, its paragraph falling back on verdict.txt (a verdict.json too big or half-written)."""
    data = _json_object(data_text)
    text = data.get("verdict") if isinstance(data.get("verdict"), str) else (paragraph or "").strip()
    if not text and not isinstance(data.get("step"), int):
        return None  # neither a paragraph nor a step: nothing a person could act on
    ranks = data.get("ranks")
    return {
        **data,
        "verdict": text,
        "ranks": [r for r in ranks if isinstance(r, dict)] if isinstance(ranks, list) else [],
    }


def parse_stragglers(text: Optional[str]) -> tuple[Optional[float], list[dict[str, Any]]]:
    """(the report's time, its stragglers with a rank and a ratio); garbled entries left out."""
    data = _json_object(text)
    listed = data.get("stragglers")
    found = [
        s
        for s in (listed if isinstance(listed, list) else [])
        if isinstance(s, dict) and isinstance(s.get("rank"), int) and _number(s.get("ratio")) is not None
    ]
    return _number(data.get("time")), found


def findings_from(files: Mapping[str, str], submitted_at: float, job_id: Optional[str] = None) -> Findings:
    """Findings from the files' texts (by path relative to the run dir). Pure; never raises. Alerts that
    name a job are `job_id`'s only (its parent's, in the same run dir, are the parent's)."""
    verdict = parse_verdict(files.get(VERDICT_JSON), files.get(VERDICT_TXT))
    if verdict is not None and not _recent(verdict, submitted_at):
        verdict = None
    when, stragglers = parse_stragglers(files.get(STRAGGLERS))
    if when is not None and when < submitted_at - SLACK_S:
        stragglers = []
    prefix = ENV_DIR + "/"
    records = [parse_record(text) for name, text in sorted(files.items()) if name.startswith(prefix)]
    mismatches = env_mismatches(newest_run(r for r in records if r is not None))
    mine = [a for a in parse_alerts(files.get(ALERTS)) if job_id is None or a.get("job") in (None, job_id)]
    alerts = [a for a in mine if _recent(a, submitted_at)][-ALERTS_KEPT:]
    gpus = parse_gpus(files.get(GPU_METRICS), submitted_at)
    return Findings(
        verdict=verdict,
        stragglers=stragglers,
        env_mismatches=mismatches,
        alerts=alerts,
        gpus=gpus,
        steps=parse_steps(files.get(SPEC)),
        engine=parse_engine(files.get(SPEC)),
        checkpoint_step=parse_last_checkpoint(files.get(LAST_CHECKPOINT), job_id),
        goodput=parse_goodput(files.get(posixpath.join(GOODPUT_DIR, f"{job_id}.json")) if job_id else None, job_id),
        run_goodput=run_total(files) if job_id else None,
        energy=parse_energy(files, job_id),
        spec_gpus=parse_spec_gpus(files.get(SPEC)),
        price=parse_price(files.get(SPEC)),
    )


def parse_energy(files: Mapping[str, str], job_id: Optional[str]) -> Optional[dict[str, Any]]:
    """The job's energy over its nodes' records (ENERGY_DIR/JOB.NODE.json); None without one."""
    if job_id is None:
        return None
    prefix = f"{ENERGY_DIR}/{job_id}."
    records = [energy.parse(text, job_id) for name, text in sorted(files.items()) if name.startswith(prefix)]
    return energy.total(r for r in records if r is not None)


def parse_spec_gpus(text: Optional[str]) -> Optional[int]:
    """spec.json's nodes x gpus_per_node; None without a spec.json."""
    resources = _spec_job(text).get("resources")
    if not isinstance(resources, dict):
        return None
    nodes, gpus = resources.get("nodes"), resources.get("gpus_per_node")
    if isinstance(nodes, bool) or isinstance(gpus, bool) or not isinstance(nodes, int) or not isinstance(gpus, int):
        return None
    return nodes * gpus


def parse_price(text: Optional[str]) -> tuple[float, str]:
    """spec.json's run.gpu_hour_price and currency ((0.0, "") when unpriced)."""
    run = _json_object(text).get("run")
    price = _number(run.get("gpu_hour_price")) if isinstance(run, dict) else None
    currency = run.get("currency") if isinstance(run, dict) else None
    return (price, currency) if price and price > 0 and isinstance(currency, str) else (0.0, "")


def run_total(files: Mapping[str, str]) -> Optional[dict[str, Any]]:
    """Every whole goodput record of the run dir summed (None unless it holds more than one job's)."""
    prefix = GOODPUT_DIR + "/"
    records = [
        record
        for name, text in sorted(files.items())
        if name.startswith(prefix)
        and name.endswith(".json")
        and (record := parse_goodput(text, name[len(prefix) : -len(".json")])) is not None
    ]
    if len(records) < 2:
        return None
    allocated = sum(float(r["allocated_s"]) for r in records)
    productive = sum(float(r["parts_s"].get("productive", 0)) for r in records)
    return {
        "jobs": len(records),
        "allocated_s": round(allocated, 3),
        "productive_s": round(productive, 3),
        "lost_steps": sum(int(r.get("lost_steps") or 0) for r in records),
        "effective_pct": round(100.0 * productive / allocated, 2) if allocated > 0 else None,
    }


def parse_goodput(text: Optional[str], job_id: Optional[str]) -> Optional[dict[str, Any]]:
    """This job's goodput record when it is whole (its parts and allocated time numbers), else None."""
    record = _json_object(text)
    parts = record.get("parts_s")
    allocated = _number(record.get("allocated_s"))
    if record.get("job") != job_id or allocated is None or not isinstance(parts, dict):
        return None
    if not all(_number(v) is not None for v in parts.values()):
        return None
    return record


def parse_last_checkpoint(text: Optional[str], job_id: Optional[str]) -> Optional[int]:
    """RunDir.last_checkpoint's step when this job made it (a record naming no job counts for any)."""
    record = _json_object(text)
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None
    return step if job_id is None or record.get("job") in (None, job_id) else None


def _spec_job(text: Optional[str]) -> dict[str, Any]:
    """spec.json's `job` object ({} when absent or garbled)."""
    job = _json_object(text).get("job")
    return job if isinstance(job, dict) else {}


def parse_steps(text: Optional[str]) -> Optional[int]:
    """spec.json's job.train.steps (a command job has no steps)."""
    job = _spec_job(text)
    if job.get("command"):
        return None
    train = job.get("train")
    steps = train.get("steps") if isinstance(train, dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def parse_engine(text: Optional[str]) -> Optional[str]:
    """spec.json's engine in one phrase ('native (fsdp)', 'deepspeed ZeRO-3, optimizer offload'); None for a
    command job or a spec.json that does not parse."""
    return dsconfig.plain_summary(_spec_job(text))


def _json_lines(text: Optional[str]) -> list[dict[str, Any]]:
    """Every whole JSON object line of a tail (its cut first line, or a line being written, is skipped)."""
    rows = []
    for line in (text or "").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def parse_alerts(text: Optional[str]) -> list[dict[str, Any]]:
    """alerts.jsonl's records (launcher/contract/records/alerts.py), oldest first; a record naming no known rule is left out."""
    from meshrun.launcher.contract.records.alerts import RULES

    return [row for row in _json_lines(text) if row.get("rule") in RULES]


def parse_gpus(text: Optional[str], submitted_at: float) -> list[dict[str, Any]]:
    """The newest sample of each GPU (by node and uuid) in a gpu.jsonl tail, ordered by rank."""
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in _json_lines(text):
        if row.get("kind") == "gpu" and _recent(row, submitted_at):
            newest[(str(row.get("node")), str(row.get("uuid", row.get("rank"))))] = row
    return sorted(newest.values(), key=_rank_order)


def _rank_order(row: Mapping[str, Any]) -> int:
    rank = row.get("rank")
    return rank if isinstance(rank, int) else 1 << 30
