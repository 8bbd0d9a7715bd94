"""`meshrun resume` and `meshrun export`: continuing a job, and getting its weights out.

resume starts the job's own script again in the same run dir (a new Slurm job, or a
new local supervisor); the ranks find the newest complete checkpoint themselves. It
also clears the crash-loop guard's count: a person deciding to go on is new evidence.
export runs `python -m meshrun.launcher.export` where the checkpoint is (this machine for a
local transport; the login node over SSH, then downloads the file, or the folder's files for --format hf).
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from meshrun.launcher.contract.records.rundir import ATTEMPTS_FILE, RunDir
from meshrun.launcher.contract.spec import hfnames
from meshrun.launcher.contract.spec.job import RunSpec
from meshrun.submit.core.registry import JobRecord, Registry, now
from meshrun.submit.core.runspec import read_run_spec
from meshrun.submit.core.state import JobState
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.transport.base import Result, Transport

RESUME_SETTABLE = (
    "train.steps",
    "train.lr",
    "train.min_lr",
    "train.warmup_steps",
    "train.log_every",
    "train.eval_every",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.keep_every",
    "checkpoint.max_requeues",
    "checkpoint.resume_step",
)
"""What `resume --set` may change: the length, the schedule, the cadences, the requeue budget, which
complete checkpoint to start from (an earlier one, before a loss climbed); never the model, the layout
or the data, which the checkpoint must match."""


def checkpoint_dir(record: JobRecord, transport: Transport) -> str:
    run = read_run_spec(record, transport).run
    return run.checkpoint_dir or RunDir(record.run_dir).default_checkpoints


def with_overrides(run_spec: RunSpec, overrides: Sequence[str]) -> RunSpec:
    """The run spec with `resume --set` applied (validated like a submit's); only RESUME_SETTABLE keys."""
    from meshrun.launcher.contract.spec import schema
    from meshrun.launcher.contract.spec.job import JobSpec, check_ranges

    for item in overrides:
        key = item.partition("=")[0].strip()
        if key not in RESUME_SETTABLE:
            raise InputError(
                "--set",
                item,
                f"a resume may change only {', '.join(RESUME_SETTABLE)}; the model, "
                f"the layout and the data must match the checkpoints",
            )
    try:
        data = schema.apply_overrides(JobSpec, schema.to_plain(run_spec.job), overrides)
        job = schema.load(JobSpec, data)
    except schema.SchemaError as exc:
        raise InputError(f"--set {exc.key}", exc.value, exc.fix) from None
    try:
        check_ranges(job)  # checkpoint cadence and the requeue guard among them
    except schema.SchemaError as exc:
        raise InputError(exc.key, exc.value, exc.fix) from None
    return dataclasses.replace(run_spec, job=job)


def resume(
    record: JobRecord,
    transport: Transport,
    registry: Registry,
    state: JobState,
    is_done: bool,
    restart: Callable[[JobRecord, Transport], str],
    overrides: Sequence[str] = (),
) -> JobRecord:
    """Start the stopped/failed/killed job again in its run dir; returns the new job's record. `restart` starts
    the job's own script again and returns the new job id (its scheduler backend's, handed in by api.resume)."""
    if "_" in record.job_id:
        raise InputError(
            "JOB",
            record.job_id,
            "resume a whole sweep task by resubmitting it; array tasks cannot be restarted one by one",
        )
    run_spec = read_run_spec(record, transport)  # also: is the run dir still there?
    if not is_done:
        raise InputError("JOB", record.job_id, f"the job is still {state}; cancel it first or wait")
    if state == JobState.COMPLETED and not overrides:
        raise InputError(
            "JOB",
            record.job_id,
            "the job completed: there is nothing left to train; to train "
            "further, `meshrun resume JOB --set train.steps=N` with a larger N",
        )
    root = run_spec.run.checkpoint_dir or RunDir(record.run_dir).default_checkpoints
    changed = with_overrides(run_spec, overrides) if overrides else run_spec
    if state == JobState.COMPLETED:
        check_trains_further(run_spec, changed)
    else:
        check_steps_left(changed, root, transport)
    if overrides:
        from meshrun.launcher.contract.spec.job import dumps_run_spec

        transport.write_text(RunDir(record.run_dir).spec, dumps_run_spec(changed))
    transport.run(["rm", "-f", "--", f"{root}/{ATTEMPTS_FILE}"]).check("rm")
    job_id = restart(record, transport)
    new = record.resubmitted(job_id, now())
    registry.add(new)
    return new


def check_trains_further(done: RunSpec, again: RunSpec) -> None:
    """A completed trainer job resumes only to train more steps than it did (else it would train nothing)."""
    if done.job.command is not None or again.job.command is not None:
        return  # a program's own notion of "done" is its own
    trained, asked = done.job.trainer.steps, again.job.trainer.steps
    if asked <= trained:
        raise InputError(
            "train.steps",
            asked,
            f"the job completed all {trained} of its steps: give more than {trained} to train further",
        )


def check_steps_left(run_spec: RunSpec, root: str, transport: Transport) -> None:
    """A stopped trainer job resumes only when its newest complete checkpoint is short of train.steps: one
    that saved its last step before it was stopped (a cancel as it finished) would train nothing and
    end COMPLETED with no step of its own (found by a journey)."""
    job = run_spec.job
    if job.command is not None or job.checkpoint.resume_step is not None:
        return  # a program's own notion of "done" is its own; an earlier step was asked for
    complete = complete_steps(transport, root)
    if complete and complete[-1] >= job.trainer.steps:
        raise InputError(
            "train.steps",
            job.trainer.steps,
            f"the job's newest checkpoint is step {complete[-1]}: nothing is left to train; "
            f"`meshrun resume JOB --set train.steps=N` with N above {complete[-1]} trains further",
        )


def code_dir(record: JobRecord, transport: Transport) -> Optional[str]:
    """The code snapshot the job ran with (its script exports MESHRUN_CODE_DIR), if any."""
    script = transport.read_bytes(RunDir(record.run_dir).script(record.scheduler), 0, 1 << 20).decode()
    for line in script.splitlines():
        if line.startswith("export MESHRUN_CODE_DIR="):
            return shlex.split(line.split("=", 1)[1])[0]
    return None


def _remote_script(setup: tuple[str, ...], python: str, argv: list[str], code: Optional[str]) -> str:
    """The cluster's setup lines (trusted, verbatim), then the export with every value quoted,
    with the job's code snapshot importable as it was for the ranks."""
    lines = list(setup)
    if code:  # importable as it was for the ranks; no bytecode written into the shared snapshot
        lines.append(f'export PYTHONPATH={shlex.quote(code)}"${{PYTHONPATH:+:$PYTHONPATH}}" PYTHONDONTWRITEBYTECODE=1')
    return "\n".join([*lines, "exec " + shlex.join([python, *argv])])


MARKER = "meshrun-complete.json"
"""meshrun.launcher.checkpoint.commit.MARKER (a unit test keeps them equal: submit imports only launcher's contract)."""
_VAL_LOSS = re.compile(r"/step-(\d{8,})/" + re.escape(MARKER) + r':"val_loss": ([-+0-9.eE]+)$')


_STEP_MARKER = re.compile(r"/step-(\d{8,})/" + re.escape(MARKER) + r"$")
METRICS_TAIL = 1 << 18
"""The end of metrics.jsonl read for the job's last checkpoint events (a few thousand lines)."""


def complete_steps(transport: Transport, root: str) -> list[int]:
    """The complete checkpoints' steps under `root`, ascending (one command over the transport)."""
    argv = ["find", root, "-mindepth", "2", "-maxdepth", "2", "-name", MARKER]
    found = (_STEP_MARKER.search(line.strip()) for line in transport.run(argv, timeout=60).stdout.splitlines())
    return sorted(int(match.group(1)) for match in found if match)


def check_step(step: int, complete: Sequence[int], root: str) -> None:
    """--step N names a complete checkpoint, or it is bad input naming the ones there are."""
    if step not in complete:
        there = ", ".join(map(str, complete)) if complete else "none yet"
        raise InputError("--step", step, f"no complete checkpoint of that step under {root}; complete steps: {there}")


def last_saved_step(record: JobRecord, transport: Transport) -> Optional[int]:
    """The newest checkpoint step the job's ranks reported saving (on scratch or shared storage), if any."""
    from meshrun.launcher.contract.records.lost import saved_steps

    path = RunDir(record.run_dir).metrics
    try:
        size = transport.size(path)
    except (OSError, ClusterError):
        return None
    text = transport.read_bytes(path, max(0, size - METRICS_TAIL), METRICS_TAIL).decode("utf-8", errors="replace")
    steps = saved_steps(text, record.job_id)  # its own: a later job of the run dir (a resume) saves there too
    return steps[-1] if steps else None


def not_the_last(record: JobRecord, transport: Transport, step: Optional[int]) -> Optional[str]:
    """When `step` (the one resume or export uses) is older than the job's last saved checkpoint: a note
    naming both (the newer one never became complete on shared storage: see its checkpoint_lost alert)."""
    last = last_saved_step(record, transport)
    if last is None or (step is not None and step >= last):
        return None
    used = f"step {step}" if step is not None else "no checkpoint (step 0)"
    return (
        f"note: this uses {used}: the job's last checkpoint, step {last}, never became complete on shared "
        f"storage (see `meshrun status {record.job_id}`)"
    )


def resume_note(record: JobRecord, transport: Transport, parent: Optional[JobRecord] = None) -> Optional[str]:
    """After a resume (`record`, the new job, of `parent`): the step it starts from when that is not the parent's
    last checkpoint (None otherwise, and when checkpoint.resume_step chose it)."""
    run = read_run_spec(record, transport)
    if run.job.checkpoint.resume_step is not None:
        return None
    complete = complete_steps(transport, run.run.checkpoint_dir or RunDir(record.run_dir).default_checkpoints)
    return not_the_last(parent or record, transport, complete[-1] if complete else None)


def export_note(record: JobRecord, transport: Transport, exported: str) -> Optional[str]:
    """After an export of the newest complete step: a note when that is not the job's last checkpoint (older:
    the newer never completed; newer: a later job of the run dir, a resume, made it)."""
    match = re.search(r"step-(\d+)/?$", exported.strip())
    if not match:
        return None
    step = int(match.group(1))
    last = last_saved_step(record, transport)
    if last is not None and step > last:
        return (
            f"note: step {step} is the run dir's newest checkpoint, made by a later job there (a resume); job "
            f"{record.job_id}'s own last is step {last}: `--step {last}` exports it"
        )
    return not_the_last(record, transport, step)


def best_checkpoint(transport: Transport, root: str) -> Optional[tuple[int, float]]:
    """(step, val_loss) of the complete checkpoint under `root` whose marker records the lowest
    val_loss (`checkpoint.keep_best`); None when none does. One command over the transport (for
    `meshrun status` and `export --best`): grep over the markers, no listing round trips."""
    argv = ["find", root, "-mindepth", "2", "-maxdepth", "2", "-name", MARKER]
    argv += ["-exec", "grep", "-H", "-o", '"val_loss": [^,}]*', "{}", "+"]
    found: dict[int, float] = {}
    for line in transport.run(argv, timeout=60).stdout.splitlines():
        match = _VAL_LOSS.search(line.strip())
        if match:
            try:
                value = float(match.group(2))
            except ValueError:
                continue
            if math.isfinite(value):
                found[int(match.group(1))] = value
    if not found:
        return None
    step = min(found, key=lambda s: (found[s], -s))  # as meshrun.launcher.checkpoint.commit.lowest_val_loss
    return step, found[step]


def best_step(record: JobRecord, transport: Transport) -> int:
    """The step `export --best` exports; one line saying why when there is none."""
    found = best_checkpoint(transport, checkpoint_dir(record, transport))
    if found is None:
        raise InputError(
            "--best",
            record.job_id,
            "no complete checkpoint of this job records a val_loss: submit with checkpoint.keep_best: true "
            "and checkpoint.every a multiple of train.eval_every (or export --step N)",
        )
    return found[0]


def check_output(out: Path, fmt: str = "meshrun", example: str = "model.safetensors") -> Path:
    """-o names a file (--format hf: a folder) whose folder exists (checked before anything runs on the cluster);
    `example`, the file name the error suggests (render's -o uses it too)."""
    out = Path(out).expanduser().absolute()
    if fmt == "hf" and not hfnames.replaceable_folder(out):
        raise InputError("-o/--output", str(out), "exists and is no earlier hf export; give a new folder name")
    if fmt == "meshrun" and out.is_dir():
        raise InputError("-o/--output", str(out), f"is a folder; give a file name, e.g. {out / example}")
    if not out.parent.is_dir():
        raise InputError("-o/--output", str(out), f"folder {out.parent} does not exist; create it first")
    return out


def export(
    record: JobRecord,
    transport: Transport,
    profile: Any,
    out: Path,
    step: Optional[int],
    progress: Callable[[str], None] = lambda line: None,
    best: bool = False,
    fmt: str = "meshrun",
    max_shard_size: str = "5GB",
) -> str:
    """Write consolidated safetensors weights to `out` (a file, or for fmt "hf" a Hugging Face folder);
    returns the checkpoint exported. Without --step the launcher takes the newest complete step itself,
    again if retention deletes it mid-read; with `best` the one with the lowest recorded val_loss
    (retention never deletes it)."""
    out = check_output(out, fmt)
    try:
        hfnames.parse_size(max_shard_size)
    except ValueError as exc:
        raise InputError("--max-shard-size", max_shard_size, str(exc).split("; ", 1)[1]) from None
    if best:
        step = best_step(record, transport)
    root = checkpoint_dir(record, transport)
    if step is not None and not best:
        check_step(step, complete_steps(transport, root), root)
    ckpt = root if step is None else f"{root}/step-{step:08d}"
    args = ["-m", "meshrun.launcher.export", ckpt]
    options = ["--format", fmt, "--max-shard-size", max_shard_size]
    if profile.ssh is None:
        done = transport.run([sys.executable, *args, str(out), *options], timeout=3600)
        _check_export(done, "export")
        return _exported(done.stdout, ckpt)
    remote = f"{record.run_dir}/.export-{secrets.token_hex(4)}" + (".safetensors" if fmt == "meshrun" else "")
    script = _remote_script(profile.setup, profile.python, [*args, remote, *options], code_dir(record, transport))
    done = transport.run(["bash", "-c", script], timeout=3600)
    try:
        _check_export(done, "export on the cluster")
        if fmt == "hf":
            _download_folder(transport, remote, out, progress)
        else:
            _download(transport, remote, out, progress)
    finally:
        transport.run(["rm", "-rf", "--", remote])
    return _exported(done.stdout, ckpt)


def _check_export(done: Result, what: str) -> None:
    """The exporter's own one-line error (`meshrun export: ...`) as meshrun's, without its prefix twice."""
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        said = lines[-1].removeprefix("meshrun export: ") if lines else f"exit code {done.returncode}"
        raise ClusterError(f"{what}: {said}")


def _exported(stdout: str, asked: str) -> str:
    """The step folder the launcher says it exported (it chooses the newest one itself)."""
    for line in reversed(stdout.splitlines()):
        if " from " in line:
            return line.rsplit(" from ", 1)[1].strip()
    return asked


def _download_folder(transport: Transport, remote: str, out: Path, progress: Callable[[str], None]) -> None:
    """The export folder's files (flat: weights, index, config, tokenizer) into OUT, replaced whole."""
    listing = transport.run(["ls", "-1", "--", remote]).check("list the export")
    tmp = out.with_name(f".{out.name}.part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name in listing.stdout.split():
        _download(transport, f"{remote}/{name}", tmp / name, progress)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def _download(transport: Transport, remote: str, out: Path, progress: Callable[[str], None]) -> None:
    size, offset = transport.size(remote), 0
    tmp = out.with_name(f".{out.name}.part")
    with open(tmp, "wb") as handle:
        while offset < size:
            chunk = transport.read_bytes(remote, offset, 8 << 20)
            if not chunk:
                raise ClusterError(f"download of {remote} stopped at {offset} of {size} bytes")
            handle.write(chunk)
            offset += len(chunk)
            progress(f"{offset / 1e6:.1f}/{size / 1e6:.1f} MB")
    tmp.replace(out)
