"""The 3D trainer's pure parts, in one process: layout arithmetic, device choice, schedule, scaling, metrics."""

from __future__ import annotations

import math
from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from meshrun.launcher.contract.spec.job import JobSpec, Resources, Train
from meshrun.launcher.contract.spec.parallel_dims import MESH_DIMS, Coordinates, ParallelDims
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.train.metrics import MetricsLog, perplexity
from meshrun.launcher.train.optim import LossScaler, clip_factor, global_grad_norm, lr_at
from meshrun.launcher.train.runtime import check_tasks, gpu_index, visible_gpus


def _env(rank: int = 0, local: int = 0, world: int = 8, local_world: int = 8, node: int = 0) -> RankEnv:
    return RankEnv(
        rank=rank,
        local_rank=local,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=world // local_world,
        master_addr="n1",
        master_port=20001,
        job_id="7",
        restart_count=0,
        hosts=(),
        source="torchrun",
    )


# ------------------------------------------------------------------ ParallelDims


def test_coordinates_put_tp_innermost_then_dp_then_pp() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert MESH_DIMS == ("pp", "dp", "tp") and dims.shape == (2, 2, 2)
    assert [dims.coordinates(r) for r in (0, 1, 2, 5, 7)] == [
        Coordinates(0, 0, 0),
        Coordinates(0, 0, 1),
        Coordinates(0, 1, 0),
        Coordinates(1, 0, 1),
        Coordinates(1, 1, 1),
    ]
    with pytest.raises(ValueError, match="outside"):
        dims.coordinates(8)


@pytest.fixture
def fake_world() -> Iterator[None]:
    """A fake 8-rank process group (no peers needed) so init_device_mesh can lay out a real mesh."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_device_mesh_agrees_with_the_coordinates(fake_world: None) -> None:
    from meshrun.launcher.train.parallel import build_mesh
    from meshrun.launcher.train.runtime import Runtime

    dims = ParallelDims(dp=2, tp=2, pp=2)
    mesh = build_mesh(dims, Runtime(torch.device("cpu"), "gloo", None))
    c = dims.coordinates(5)
    assert tuple(mesh.get_coordinate()) == (c.pp, c.dp, c.tp)
    assert mesh["tp"].mesh.tolist() == [4, 5]  # consecutive ranks: one node's
    assert mesh["dp"].mesh.tolist() == [5, 7] and mesh["pp"].mesh.tolist() == [1, 5]


@pytest.mark.parametrize(
    "kwargs, key, text",
    [
        (dict(vocab_size=250), "parallel.tp", "vocab_size(250) must be divisible by tp(4)"),
        (dict(seq_len=30, sequence_parallel=True), "parallel.sequence_parallel", "seq_len(30) over tp(4)"),
    ],
)
def test_tensor_parallel_checks(kwargs: dict, key: str, text: str) -> None:
    found = ParallelDims(dp=2, tp=4, pp=1).problem(8, 4, 8, 8, **kwargs)
    assert found is not None and found.key == key and text in found.fix
    assert (
        ParallelDims(dp=2, tp=4, pp=1).problem(8, 4, 8, 8, vocab_size=256, seq_len=32, sequence_parallel=True) is None
    )


def test_pipeline_needs_at_least_pp_micro_batches() -> None:
    dims = ParallelDims(dp=2, tp=1, pp=4)
    found = dims.batch_problem(global_batch=8, micro_batch=2)  # accumulation 2 < 4 stages
    assert found is not None and "fewer than the pp(4) pipeline stages" in found.fix and "16" in found.fix
    assert dims.batch_problem(global_batch=16, micro_batch=2) is None
    assert ParallelDims(dp=2).batch_problem(8, 4) is None  # pp = 1: accumulation 1 is fine


# ------------------------------------------------------------------ tasks and GPUs


def test_task_count_must_match_the_spec() -> None:
    job = JobSpec(name="j", resources=Resources(nodes=2, tasks_per_node=4))
    check_tasks(job, _env(world=8, local_world=4))
    with pytest.raises(SchemaError, match=r"4 rank\(s\) started but the spec asks for nodes\(2\)"):
        check_tasks(job, _env(world=4, local_world=4))
    with pytest.raises(SchemaError, match=r"runs 8 rank\(s\), not 4"):
        check_tasks(job, _env(world=8, local_world=8))


def test_visible_gpus_reads_indexes_and_uuids() -> None:
    assert visible_gpus({}) is None
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1a2b,GPU-3c4d"}) == ("GPU-1a2b", "GPU-3c4d")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3"}) == ("3",)


def test_gpu_index_own_gpu_or_local_rank() -> None:
    # One GPU visible per task (Slurm --gpus-per-task=1, or a per-task cgroup): always index 0.
    assert gpu_index(_env(rank=13, local=5), 8, 1, ("GPU-abc",)) == 0
    # The whole node visible: local rank i uses GPU i.
    assert gpu_index(_env(rank=13, local=5), 8, 8, ("0", "1", "2", "3", "4", "5", "6", "7")) == 5
    assert gpu_index(_env(rank=13, local=5), 8, 8, None) == 5


def test_gpu_mismatches_fail_with_one_line() -> None:
    with pytest.raises(SchemaError, match=r"sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\) but its node runs 8"):
        gpu_index(_env(local=3), 8, 2, ("0", "1"))
    with pytest.raises(SchemaError, match="more ranks per node than resources.gpus_per_node"):
        gpu_index(_env(local=3), 4, 4, None)


# ------------------------------------------------------------------ optimizer pieces


def test_lr_warmup_then_cosine_to_min() -> None:
    cfg = Train(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(5, cfg) == 0.5 and lr_at(10, cfg) == 1.0
    assert lr_at(60, cfg) == pytest.approx(0.55) and lr_at(110, cfg) == pytest.approx(0.1)


def test_global_norm_and_clip_factor_without_distribution() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.full((2, 2), 2.0)
    norm = global_grad_norm([a, b], torch.device("cpu"))
    assert float(norm) == pytest.approx(5.0)
    assert float(clip_factor(norm, 1.0)) == pytest.approx(0.2, rel=1e-5)
    assert float(clip_factor(norm, 10.0)) == 1.0 and float(clip_factor(norm, 0.0)) == 1.0


def test_loss_scaler_halves_on_overflow_and_grows_after_good_steps() -> None:
    scaler = LossScaler(enabled=True, scale=1024.0, growth_interval=2)
    assert not scaler.update(finite=False) and scaler.scale == 512.0
    assert scaler.update(True) and scaler.scale == 512.0
    assert scaler.update(True) and scaler.scale == 1024.0
    off = LossScaler(enabled=False)
    assert off.loss_multiplier() == 1.0 and off.update(False)


# ------------------------------------------------------------------ metrics


def test_metrics_line_shows_data_wait_and_perplexity(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    log = MetricsLog(str(tmp_path), enabled=True, steps=10)
    log.write(
        {
            "step": 5,
            "loss": 2.0,
            "lr": 1e-3,
            "grad_norm": 0.5,
            "tokens_per_s": 1000.0,
            "step_time_s": 0.1,
            "data_wait_s": 0.002,
            "val_loss": 1.5,
            "val_ppl": perplexity(1.5),
        }
    )
    log.close()
    line = capsys.readouterr().out
    assert "data_wait 0.002s" in line and f"val_ppl {math.exp(1.5):.2f}" in line
    assert perplexity(1e4) == math.inf
