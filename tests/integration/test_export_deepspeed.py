"""`python -m meshrun.launcher.export` of a checkpoint saved by the deepspeed engine: DeepSpeed's own save in
`step-N/deepspeed/` (ZeRO-0: whole weights in the model states file; ZeRO-2: optimizer shards per rank;
ZeRO-3: parameter shards too) becomes one safetensors file with the GPT's names, equal to the trained
module's full parameters.

The checkpoints are made here as the engine makes them: 2 gloo ranks run deepspeed.initialize on
meshrun.launcher.train.model.GPT, train 2 steps (so the weights are not the init's), save_checkpoint(step_dir.tmp,
tag="deepspeed"), and rank 0 commits the marker whose job says train.engine: deepspeed. Each rank also
saves the full parameters it trained (gathered under ZeRO-3) as the reference."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec import schema
from meshrun.launcher.contract.spec.job import Checkpoint, Data, JobSpec, Model, Parallel, Resources, Train
from tests.helpers.ranks import REPO, free_port, rank_environ

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed (bash scripts/setup.sh installs it)")

STEP = 2


def job_for(zero: int) -> JobSpec:
    return JobSpec(
        name=f"ds-export-zero{zero}",
        resources=Resources(tasks_per_node=2),
        parallel=Parallel(dp=2, zero=zero),
        train=Train(model=Model(n_layers=2, d_model=64, n_heads=4, seq_len=32), engine="deepspeed", seed=3),
        data=Data(path="/nonexistent/tokens.u16"),  # never read: the weights are all export needs
        checkpoint=Checkpoint(),
    )


STAGES = (0, 2, 3)


def save_like_the_engine(folder: str) -> None:
    """One rank (this process, under RANK/WORLD_SIZE/MASTER_*): for each ZeRO stage, train, save under
    FOLDER/zeroN, and rank 0 commits. One process group for all three: a process start is most of the cost."""
    import deepspeed

    deepspeed.init_distributed()
    for zero in STAGES:
        save_one(deepspeed, Path(folder) / f"zero{zero}", zero)
    torch.distributed.destroy_process_group()


def save_one(deepspeed: Any, root: Path, zero: int) -> None:
    from meshrun.launcher.train.model import GPT, loss_fn

    rank, job = torch.distributed.get_rank(), job_for(zero)
    model = GPT(job.trainer.model, seed=job.trainer.seed)
    config = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 4, "zero_optimization": {"stage": zero}}
    # A torch optimizer: DeepSpeed's own Adam would compile an op first; the consolidation is the same.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEP):
        tokens = torch.randint(0, job.trainer.model.vocab_size, (2, 33), generator=gen)
        engine.backward(loss_fn(engine(tokens[:, :-1]), tokens[:, 1:]))
        engine.step()
    tmp = ckptdir.step_dir(root, STEP).with_suffix(".tmp")
    engine.save_checkpoint(str(tmp), tag="deepspeed", save_latest=False)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params) if zero == 3 else contextlib.nullcontext():
        full = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    torch.save(full, root / f"reference-rank{rank}.pt")
    torch.distributed.barrier()  # every rank's shards are written before the marker
    if rank == 0:
        info = {"step": STEP, "job": {k: v for k, v in schema.to_plain(job).items() if k != "env"}}
        ckptdir.commit(tmp, ckptdir.step_dir(root, STEP), info)
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 real ranks save a checkpoint per ZeRO stage under ROOT/zeroN; ROOT."""
    root = tmp_path_factory.mktemp("ds-checkpoints")
    port = free_port()
    code = f"from tests.integration.test_export_deepspeed import save_like_the_engine as s; s({str(root)!r})"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=REPO,
            env={**rank_environ(rank, 2, port), "DS_ACCELERATOR": "cpu"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    return root


def trained(root: Path) -> dict[str, torch.Tensor]:
    """The full parameters the ranks trained (both agree)."""
    refs = [torch.load(root / f"reference-rank{r}.pt") for r in range(2)]
    assert refs[0].keys() == refs[1].keys() and all(torch.equal(refs[0][k], refs[1][k]) for k in refs[0])
    return refs[0]


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshrun.launcher.export", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("zero", STAGES)
def test_export_consolidates_deepspeed_zero_shards_into_the_gpt_weights(saved: Path, tmp_path: Path, zero: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from meshrun.launcher.train.model import GPT

    root = saved / f"zero{zero}"
    weights_of = trained(root)
    step = ckptdir.step_dir(root, STEP)
    shards = sorted(p.name for p in (step / "deepspeed").iterdir())
    # Really sharded as the stage says: optimizer state per rank from ZeRO-1 on, parameters too under ZeRO-3.
    assert len([s for s in shards if s.endswith("optim_states.pt")]) == (2 if zero else 0), shards
    assert len([s for s in shards if s.startswith("zero_pp_rank") and s.endswith("model_states.pt")]) == (
        2 if zero == 3 else 0
    ), shards

    out = tmp_path / "model.safetensors"
    done = export(str(root), str(out))  # the checkpoint root: its newest complete step, as for native
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == f"wrote {out} ({len(weights_of)} tensors) from {step}\n", done.stdout

    weights = load_file(str(out))
    job = job_for(zero)
    init = GPT(job.trainer.model, seed=job.trainer.seed).state_dict()
    assert sorted(weights) == sorted(weights_of) == sorted(init)
    for name, tensor in weights_of.items():
        assert weights[name].dtype == torch.float32 and weights[name].shape == init[name].shape, name
        assert torch.equal(weights[name], tensor), f"{name}: max diff {(weights[name] - tensor).abs().max()}"
    assert any(not torch.equal(weights[n], init[n]) for n in init)  # trained weights, not a fresh model's
    # Loads as the native export's file does: a plain GPT takes it strictly, metadata names the step.
    GPT(job.trainer.model).load_state_dict(weights, strict=True)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["step"] == str(STEP) and f.metadata()["format"] == "meshrun-gpt"
