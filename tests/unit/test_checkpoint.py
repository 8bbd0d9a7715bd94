"""Checkpoint rules: complete or ignored, retention, and a real DCP round trip in one process."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from meshrun.launcher.checkpoint import commit as ckpt
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.rank.preempt import StopFlag
from meshrun.launcher.train.divergence import Sentinel
from meshrun.launcher.train.divergence import agree as agree_and_check


def _fake_complete(root: Path, step: int) -> Path:
    path = ckptdir.step_dir(root, step)
    path.mkdir(parents=True)
    (path / ckptdir.MARKER).write_text(f'{{"step": {step}}}')
    return path


@pytest.mark.parametrize(
    "steps, keep, every, victims",
    [
        ([10, 20, 30, 40], 2, 0, [10, 20]),
        ([10, 20, 30, 40], 1, 20, [10, 30]),
        ([10], 1, 0, []),
        ([], 3, 0, []),
        ([5, 10, 15], 0, 0, [5, 10]),  # keep 0 still keeps the newest complete
    ],
)
def test_retention_never_deletes_the_newest(steps, keep, every, victims) -> None:
    assert ckptdir.retention_victims(steps, keep, every) == victims


def test_unmarked_saves_are_ignored_and_asking_for_one_is_an_error(tmp_path: Path) -> None:
    _fake_complete(tmp_path, 10)
    (tmp_path / "step-00000020.tmp").mkdir()  # interrupted save
    ckptdir.step_dir(tmp_path, 30).mkdir()  # renamed but unmarked (impossible, still ignored)
    assert ckptdir.complete_steps(tmp_path) == [10]
    assert ckptdir.latest(tmp_path) == ckptdir.step_dir(tmp_path, 10)
    assert ckptdir.resolve(tmp_path, 10) == ckptdir.step_dir(tmp_path, 10)
    with pytest.raises(ckptdir.CheckpointError, match="step 20 .* incomplete"):
        ckptdir.resolve(tmp_path, 20)
    with pytest.raises(ckptdir.CheckpointError, match="step 99 .* does not exist"):
        ckptdir.resolve(tmp_path, 99)
    assert [p.name for p in ckptdir.remove_stale(tmp_path)] == ["step-00000020.tmp"]


def test_commit_keeps_an_existing_complete_twin(tmp_path: Path) -> None:
    final = _fake_complete(tmp_path, 10)
    tmp = tmp_path / "step-00000010.tmp"
    tmp.mkdir()
    ckptdir.commit(tmp, final, {"step": 10})
    assert not tmp.exists() and ckptdir.read_marker(final) == {"step": 10}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _train_one(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, 8)).square().sum().backward()
    opt.step()


@pytest.fixture
def group(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("async_save", [False, True])
def test_dcp_round_trip_commits_and_retains(tmp_path: Path, group, async_save: bool) -> None:
    model, root = _model(), tmp_path / "ckpt"
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    saver = ckpt.Checkpointer(root, keep=2, async_save=async_save)
    saver.prepare()
    for step in (1, 2, 3):
        _train_one(model, opt)
        msd, osd = get_state_dict(model, opt)
        saver.save(step, ckpt.dcp_writer(saver, {"model": msd, "optim": osd, "step": step}), {"layout": "1x1x1"})
        # Async: training goes on while the save is in flight, and it is not complete until
        # committed (by the next poll/save/wait). Sync: complete on return.
        assert saver.in_flight is async_save
        assert (step in ckptdir.complete_steps(root)) is not async_save
    saver.wait()
    assert ckptdir.complete_steps(root) == [2, 3] and not list(root.glob("*.tmp"))
    assert ckptdir.read_marker(ckptdir.latest(root))["layout"] == "1x1x1"
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd, "step": 0}
    marker = saver.dcp_load(state, ckptdir.latest(root))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert marker["step"] == 3 and state["step"] == 3
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    # The optimizer continues identically: one more step on both gives the same parameters.
    _train_one(model, opt)
    _train_one(fresh, fresh_opt)
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_loading_an_unmarked_directory_is_refused(tmp_path: Path, group) -> None:
    (tmp_path / "step-00000005").mkdir()
    with pytest.raises(ckptdir.CheckpointError, match="no completeness marker"):
        ckpt.Checkpointer(tmp_path, keep=1).dcp_load({}, tmp_path / "step-00000005")


def agree(local: bool) -> bool:
    """The loop's per-step agreement on the stop flag (with no non-finite step seen)."""
    return agree_and_check(local, Sentinel(torch.device("cpu"), check_norm=True))[0]


def test_signal_only_sets_a_flag_and_ranks_agree(group) -> None:
    flag = StopFlag().install([signal.SIGUSR1])
    try:
        assert not agree(flag.raised)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.raised and flag.describe() == "SIGUSR1" and agree(flag.raised)
    finally:
        flag.uninstall()


def test_optimizer_state_loads_from_flat_keys_and_from_checkpoints_saved_before_them(tmp_path: Path) -> None:
    """meshrun writes the optimizer with flat per-parameter keys (each pipeline stage its own); a checkpoint
    saved earlier with nested param_groups (`optim.param_groups.0.*`) still loads, into the same state."""
    import torch.distributed.checkpoint as dcp

    from meshrun.launcher.train.engines.native import OptimizerState, saved_flat

    def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        return model, opt

    model, opt = trained()
    for flat in (True, False):
        path = tmp_path / f"flat-{flat}"
        dcp.save({"optim": OptimizerState(model, opt, flat)}, checkpoint_id=str(path))
        assert saved_flat(path) is flat
        fresh = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0, betas=(0.5, 0.5))
        dcp.load({"optim": OptimizerState(fresh, fresh_opt, saved_flat(path))}, checkpoint_id=str(path))
        assert fresh_opt.param_groups[0]["betas"] == (0.9, 0.95) and fresh_opt.param_groups[0]["lr"] == 1e-2
        for p, q in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(opt.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
