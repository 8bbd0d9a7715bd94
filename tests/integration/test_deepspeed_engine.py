"""The deepspeed engine with real ranks (CPU, gloo, fp32): parity with the native engine, kill -9 and
requeue on the real Slurm testbed, cancel / resume / export through the real CLI on `local`.

Parity: one pair of gloo processes (ds_probe.py) builds every engine in turn with build_trainer, as
the launcher does, and trains the reference model (4 layers, d_model 64, seq 32; global batch 8 =
micro 2 x dp 2 x accumulation 2) for 10 steps from the same seed and data: the native engine (FSDP2),
ZeRO 0, 1, 2, 3, ZeRO-2 with optimizer offload (DeepSpeed's CPU Adam) and ZeRO-3 with parameters offloaded too. One pair instead of one
`meshrun submit` per engine saves ~20-30 s of start-up for each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec.job import Model, read_run_spec
from meshrun.launcher.data.dataset import Layout, TokenDataset, val_steps
from meshrun.launcher.train.model import GPT, loss_fn
from tests.helpers.cli import TINY, TWO_NODES, meshrun, metrics, status, submitted, wait_for_state
from tests.helpers.ranks import TIMEOUT_S, finish, free_port, make_run, rank_environ, tiny_train

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (bash scripts/setup.sh installs it)")

PROBE = Path(__file__).with_name("ds_probe.py")
STEPS = 10
MODEL = Model(n_layers=4, d_model=64, n_heads=4, seq_len=32)  # test_parallel_numerics.py's reference model
CASES = ["zero0", "zero1", "zero2", "zero3", "zero2-offload", "zero3-offload-params"]
GQA_TIED_CASES = ["native-gqa-tied", "zero1-gqa-tied", "zero3-gqa-tied"]
"""The model with grouped-query attention and a tied head (ds_probe.py): ZeRO flattens or partitions the one
shared matrix once, and its gradient gathers both uses, as FSDP2's does."""

# Tolerances, relative, at every step. Both engines run the same fp32 model from the same weights on the
# same batches with the same AdamW (torch's own under ZeRO 0-3): only the order of float32 sums differs
# (DeepSpeed averages gradients in flat buckets, FSDP2 reduce-scatters per parameter), as between the
# native layouts (test_parallel_numerics.py): measured ~1e-7 for the loss, ~1e-6 for the grad norm.
LOSS_RTOL = 1e-5
NORM_RTOL = 5e-5
# DeepSpeed's CPU Adam is its own vectorised C++ AdamW (fused multiply-adds, its own sqrt and division
# order): each step's update differs in the last bits, and the difference compounds over the steps.
# Measured here ~1e-7 after 10 steps, like the others; 10x the room keeps longer or other runs green.
OFFLOAD_RTOL = 1e-4
# The CLI tests run meshrun in a fresh HOME: the jobs reuse the ops DeepSpeed compiled under the real one
# (torch's default folder, ~/.cache/torch_extensions/py311_cpu) instead of compiling them again (~60 s each).
EXTENSIONS = {
    "TORCH_EXTENSIONS_DIR": os.environ.get(
        "TORCH_EXTENSIONS_DIR",
        str(Path.home() / ".cache" / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"),
    )
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, dict[str, Any]]:
    """Every case's losses and grad norms, from one pair of ranks."""
    train = tiny_train(model=MODEL, steps=STEPS, global_batch=8, micro_batch=2, eval_every=0)
    run_dir = make_run(tmp_path_factory.mktemp("probe"), "probe", corpus, 2, train=train)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(PROBE), str(run_dir), "native", *CASES, *GQA_TIED_CASES],
            env=rank_environ(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    out = finish(procs)[0]
    return {r["case"]: r for r in (json.loads(l) for l in out.splitlines() if l.startswith('{"case"'))}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.mark.parametrize("case", CASES)
def test_zero_stage_trains_like_the_native_engine(case: str, probed: dict[str, dict[str, Any]]) -> None:
    ref, got = probed["native"], probed[case]
    labels = {
        "zero2-offload": ["deepspeed", "ZeRO-2", "optimizer offload"],
        "zero3-offload-params": ["deepspeed", "ZeRO-3", "optimizer offload", "parameter offload"],
    }
    assert got["describe"] == labels.get(case, ["deepspeed", f"ZeRO-{case[-1]}"]), got["describe"]
    assert len(got["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0] - 1.0  # it learns: not a flat line
    loss_tol = OFFLOAD_RTOL if "offload" in case else LOSS_RTOL
    norm_tol = OFFLOAD_RTOL if "offload" in case else NORM_RTOL
    rows = [
        f"step {i + 1:2d}  loss {a:.9f} vs {b:.9f} ({relative(a, b):.1e})  "
        f"grad_norm {n:.9f} vs {m:.9f} ({relative(n, m):.1e})"
        for i, (a, b, n, m) in enumerate(zip(ref["loss"], got["loss"], ref["grad_norm"], got["grad_norm"]))
    ]
    table = f"native vs {case} (loss tolerance {loss_tol:.0e}, grad_norm {norm_tol:.0e}):\n" + "\n".join(rows)
    assert all(relative(a, b) <= loss_tol for a, b in zip(ref["loss"], got["loss"])), table
    assert all(relative(a, b) <= norm_tol for a, b in zip(ref["grad_norm"], got["grad_norm"])), table
    print(table)


@pytest.mark.parametrize("case", GQA_TIED_CASES[1:])
def test_zero_trains_a_gqa_model_with_a_tied_head_like_the_native_engine(
    case: str, probed: dict[str, dict[str, Any]]
) -> None:
    ref, got = probed["native-gqa-tied"], probed[case]
    assert ref["loss"] != probed["native"]["loss"]  # another model indeed
    assert len(got["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0] - 1.0
    assert all(relative(a, b) <= LOSS_RTOL for a, b in zip(ref["loss"], got["loss"])), (ref["loss"], got["loss"])
    assert all(relative(a, b) <= NORM_RTOL for a, b in zip(ref["grad_norm"], got["grad_norm"])), (
        ref["grad_norm"],
        got["grad_norm"],
    )


# ------------------------------------------------------------------ kill -9, requeue, resume (Slurm testbed)

TESTBED_STEPS = 24  # checkpoints at 10 and 20; the kill lands at 15, past the first
HELD_AT = 15  # the step the kill test's first attempt stops at


def _deepspeed_args(corpus: Path, zero: int, steps: int, every: int) -> list[str]:
    sets = {
        "train.engine": "deepspeed",
        "parallel.zero": zero,
        "data.path": corpus,
        "train.steps": steps,
        "train.log_every": 1,
        "train.eval_every": 0,
        "checkpoint.every": every,
    }
    return [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]


def _rank_pids(run_dir: Path) -> list[int]:
    """The job's rank processes (`python -m meshrun.launcher RUN_DIR`; not the sidecar, meshrun.launcher.sidecar)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")[:-1]
        except (OSError, ValueError):
            continue
        # srun's own command line ends the same way: a rank is the python process itself.
        if (
            len(argv) == 4
            and Path(argv[0]).name.startswith("python")
            and argv[1:] == ["-m", "meshrun.launcher", str(run_dir)]
        ):
            pids.append(int(proc.name))
    return [pid for pid in pids if _parent(pid) not in pids]  # a rank's forked helpers share its command line


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _shared_commits(run_dir: Path) -> list[int]:
    """The checkpoint steps metrics.jsonl says are complete on shared storage, as status reads them: a
    commit event saved there, or the sidecar's "copied" event for one staged on scratch (a step line's
    checkpoint_step lags: with scratch, rank 0 looks the shared step up only every few seconds)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    rows = [json.loads(line) for line in lines if line.endswith("}")]
    return [r["checkpoint_step"] for r in rows if r.get("checkpoint_step") is not None and not r.get("staged")]


def _wait_for_commit(run_dir: Path, step: int, timeout: float = 180) -> None:
    """Until checkpoint `step` (or a later one) is complete on shared storage."""
    deadline = time.monotonic() + timeout
    while not any(s >= step for s in _shared_commits(run_dir)):
        assert time.monotonic() < deadline, f"no commit of step {step} in {run_dir}: {metrics(run_dir)[-3:]}"
        time.sleep(0.05)


def test_kill_9_requeue_resumes_zero2_to_the_uninterrupted_final_loss(
    testbed: dict, tmp_path: Path, corpus: Path
) -> None:
    args = [*TWO_NODES, *_deepspeed_args(corpus, 2, TESTBED_STEPS, every=10)]
    ref_id, ref_dir = submitted(meshrun(tmp_path, "submit", *args, env=EXTENSIONS, check=True))
    # The first attempt's rank 1 stops at step 15 (MESHRUN_TEST_HANG; the watchdog's 60 s floor is far off),
    # so rank 0 finishes step 14 and waits in step 15's collective: the kill always lands mid-run, past the
    # step-10 checkpoint, whatever the machine's load (a fixed wait once let all 40 steps end first).
    held = [*args, "--set", f"env.MESHRUN_TEST_HANG=1:{HELD_AT}"]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *held, env=EXTENSIONS, check=True))
    _wait_for_commit(run_dir, 10)
    deadline = time.monotonic() + 120
    while max((r["step"] for r in metrics(run_dir)), default=0) < HELD_AT - 1:
        assert time.monotonic() < deadline, metrics(run_dir)[-3:]
        time.sleep(0.05)
    pids = _rank_pids(run_dir)
    assert len(pids) == 2, pids  # one rank on each "node"
    os.kill(pids[-1], signal.SIGKILL)  # a rank dies mid-run: srun ends the other, the batch script requeues
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=TIMEOUT_S)
    batch = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert row["state"] == "COMPLETED" and row["restarts"] == 1, (row, batch)
    assert "requeueing: restart 1" in batch, batch
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "deepspeed engine, ZeRO-2" in rank0 and "resuming from step" in rank0, rank0
    wait_for_state(tmp_path, ref_id, {"COMPLETED"}, timeout=TIMEOUT_S)
    ref, rows = metrics(ref_dir), metrics(run_dir)
    # metrics.jsonl is appended to: the steps after the checkpoint that ran before the kill come twice.
    got = list({r["step"]: r for r in rows}.values())
    assert [r["step"] for r in got] == list(range(1, TESTBED_STEPS + 1)), [r["step"] for r in rows]
    assert [r["step"] for r in rows][: HELD_AT + 3] == [*range(1, HELD_AT), *range(11, 15)], "steps 11-14 redone"
    # Bit-identical: fp32 on CPU, the same ranks, DeepSpeed's fp32 master partitions and Adam moments
    # restored exactly, the data position and every rank's RNG from the DCP part of the checkpoint.
    assert got[-1]["loss"] == ref[-1]["loss"], [(a["loss"], b["loss"]) for a, b in zip(ref, got)]
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    assert all(r["loss"] == ref[r["step"] - 1]["loss"] for r in rows)  # the redone steps too
    marker = ckptdir.read_marker(ckptdir.latest(Path(read_run_spec(run_dir).run.checkpoint_dir)))
    assert marker["engine"] == "deepspeed" and marker["step"] == TESTBED_STEPS, marker


# ------------------------------------------------------------------ cancel, resume, export (local, real CLI)


def _val_loss(weights: dict[str, torch.Tensor], run_dir: Path) -> float:
    """The validation loss of `weights` in this process, over the run's validation set."""
    job = read_run_spec(run_dir).job
    cfg = job.trainer
    model = GPT(cfg.model, seed=cfg.seed)
    model.load_state_dict(weights)
    dataset = TokenDataset(job.data.path, cfg.model.seq_len, job.data.val_fraction)
    layout = Layout(cfg.global_batch, cfg.micro_batch, dp_rank=0, dp_size=1)
    with torch.no_grad():
        losses = [float(loss_fn(model(x), y)) for mbs in val_steps(dataset, layout, cfg.eval_sequences) for x, y in mbs]
    return sum(losses) / len(losses)


def test_local_zero3_cancel_resume_and_export_of_the_consolidated_model(tmp_path: Path, corpus: Path) -> None:
    steps = 60
    args = [*TINY, *_deepspeed_args(corpus, 3, steps, every=5), "--set", f"train.eval_every={steps}"]
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", *args, env=EXTENSIONS, check=True))
    _wait_for_commit(run_dir, 5)
    meshrun(tmp_path, "cancel", job_id, check=True)
    row = wait_for_state(tmp_path, job_id, {"CANCELLED", "FAILED"})
    assert row["state"] == "CANCELLED" and row["progress"].get("checkpoint_step", 0) >= 5, row
    out = meshrun(tmp_path, "resume", job_id, "--wait", env=EXTENSIONS, timeout=TIMEOUT_S, check=True)
    assert f"resumed job {job_id} as job local-" in out.stdout and "COMPLETED" in out.stdout, out.stdout
    assert status(tmp_path, out.stdout.split()[5])["state"] == "COMPLETED"
    rows = metrics(run_dir)
    assert rows[-1]["step"] == steps and "val_loss" in rows[-1], rows[-1]
    assert "resuming from step" in (run_dir / "logs" / "rank-0.log").read_text()
    logs = "".join((run_dir / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1))
    assert "Warning: " not in logs, [line for line in logs.splitlines() if "Warning: " in line]
    target = tmp_path / "model.safetensors"
    meshrun(tmp_path, "export", job_id, "-o", str(target), check=True)
    weights = load_file(str(target))
    cfg = read_run_spec(run_dir).job.trainer
    like = GPT(cfg.model, seed=cfg.seed).state_dict()
    assert {k: tuple(v.shape) for k, v in weights.items()} == {k: tuple(v.shape) for k, v in like.items()}
    # ZeRO-3 shards every parameter over both ranks: only whole, correctly gathered weights give back
    # the loss the ranks measured on the validation set at the last step (same set, same micro batches).
    assert relative(rows[-1]["val_loss"], _val_loss(weights, run_dir)) <= LOSS_RTOL, rows[-1]
