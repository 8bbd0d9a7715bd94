"""Rank 0's loss rules (launcher/train/lossrules.py), the divergence sentinel, keep_best's retention and the
best checkpoint as `meshrun status` / `export --best` find it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec.job import Alerts
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.testing.faults import faults_for
from meshrun.launcher.train.lossrules import LossRules


def _record(step: int, **kw: Any) -> dict[str, Any]:
    return {"step": step, "loss": 2.0, "grad_norm": 1.0, "data_wait_s": 0.0, "step_time_s": 1.0, "time": 5.0, **kw}


def _rules(**kw: Any) -> LossRules:
    return LossRules(Alerts(**kw), rank=0, node="n1")


def test_loss_spike_waits_for_ten_values_then_fires_once_per_streak() -> None:
    rules = _rules(loss_spike_factor=3.0)
    assert rules.observe(_record(1, loss=100.0)) == []  # no history yet: nothing to compare with
    found = [a for s in range(2, 11) for a in rules.observe(_record(s, loss=1.0))]
    assert found == []
    (spike,) = rules.observe(_record(11, loss=3.5))
    assert spike.rule == "loss_spike" and spike.step == 11 and spike.threshold == 3.0 and spike.value == 3.5
    assert spike.rank == 0 and spike.node == "n1" and spike.time == 5.0 and "train.lr" in spike.message
    assert rules.observe(_record(12, loss=4.0)) == []  # the same streak
    assert rules.observe(_record(13, loss=1.0)) == []
    assert [a.rule for a in rules.observe(_record(14, loss=9.0))] == ["loss_spike"]  # a new streak


def test_spike_median_is_over_the_window_only() -> None:
    rules = _rules(loss_spike_factor=3.0, window=10)
    for step in range(1, 11):
        rules.observe(_record(step, loss=100.0))
    for step in range(11, 21):  # the old, high values leave the window
        assert rules.observe(_record(step, loss=1.0)) == []
    assert [a.rule for a in rules.observe(_record(21, loss=4.0))] == ["loss_spike"]


def test_grad_norm_spike_and_rules_turned_off() -> None:
    rules = _rules(grad_norm_spike_factor=10.0)
    for step in range(1, 11):
        rules.observe(_record(step, grad_norm=0.5))
    assert [a.rule for a in rules.observe(_record(11, grad_norm=6.0))] == ["grad_norm_spike"]
    off = _rules(loss_spike_factor=0, grad_norm_spike_factor=0, val_patience=0, data_wait_fraction=0)
    for step in range(1, 11):
        off.observe(_record(step, val_loss=1.0))
    assert off.observe(_record(11, loss=1e9, grad_norm=1e9, val_loss=5.0, data_wait_s=0.9)) == []


def test_a_non_finite_or_missing_value_is_never_judged_nor_kept() -> None:
    rules = _rules()
    for step in range(1, 11):
        rules.observe(_record(step, loss=1.0))
    assert rules.observe(_record(11, loss=None, grad_norm=math.nan)) == []
    assert rules.observe(_record(12, loss=math.inf)) == []
    assert len(rules.loss.history) == 10


def test_val_not_improving_fires_once_per_streak() -> None:
    rules = _rules(val_patience=2)
    seen = []
    for step, val in enumerate([3.0, 2.5, 2.6, 2.7, 2.8, 2.4, 2.5, 2.45], start=1):
        seen += [(a.step, a.value, a.threshold) for a in rules.observe(_record(step, val_loss=val))]
    assert seen == [(4, 2.7, 2.5), (8, 2.45, 2.4)]
    assert rules.observe(_record(9)) == []  # a logged step without validation counts no evaluation


def test_data_wait_fires_after_three_logged_steps_in_a_row_once_per_streak() -> None:
    rules = _rules(data_wait_fraction=0.2)
    waits = [0.4, 0.4, 0.05, 0.4, 0.4, 0.4, 0.4, 0.1, 0.4, 0.4, 0.4]
    fired = [(s, a.value) for s, w in enumerate(waits, 1) for a in rules.observe(_record(s, data_wait_s=w))]
    assert fired == [(6, 0.4), (11, 0.4)]
    assert rules.observe(_record(12, data_wait_s=0.5, step_time_s=0)) == []  # nothing to divide by


def test_data_delay_fault_is_read_and_checked() -> None:
    assert faults_for(0, 0, {"MESHRUN_TEST_DATA_DELAY": "0.25"}).data_delay_s == 0.25
    assert faults_for(1, 1, {"MESHRUN_TEST_DATA_DELAY": "0.25"}).data_delay_s == 0  # not after a requeue
    with pytest.raises(SchemaError, match="MESHRUN_TEST_DATA_DELAY"):
        faults_for(0, 0, {"MESHRUN_TEST_DATA_DELAY": "soon"})


def test_the_sentinel_keeps_the_first_non_finite_step() -> None:
    import torch

    from meshrun.launcher.train import divergence

    norm = divergence.Sentinel(torch.device("cpu"), check_norm=True)
    fp16 = divergence.Sentinel(torch.device("cpu"), check_norm=False)
    one, nan, inf = torch.tensor(1.0), torch.tensor(math.nan), torch.tensor(math.inf)
    for sentinel in (norm, fp16):
        sentinel.observe(1, one, one)
        sentinel.observe(2, one, inf)  # fp16: an overflow the loss scaler skips, not a divergence
    assert divergence.agree(False, norm) == (False, 2) and divergence.agree(True, fp16) == (True, None)
    for sentinel in (norm, fp16):
        sentinel.observe(3, nan, one)
        sentinel.observe(4, nan, nan)
    assert divergence.agree(False, norm) == (False, 2) and divergence.agree(False, fp16) == (False, 3)


# ------------------------------------------------------------------ keep_best


def _checkpoint(root: Path, step: int, val_loss: Any = None) -> None:
    info: dict[str, Any] = {"step": step} if val_loss is None else {"step": step, "val_loss": val_loss}
    path = ckptdir.step_dir(root, step)
    path.mkdir(parents=True)
    (path / ckptdir.MARKER).write_text(json.dumps(info, sort_keys=True))


def test_retention_never_deletes_the_lowest_recorded_val_loss(tmp_path: Path) -> None:
    for step, val in [(10, 3.0), (20, 2.0), (30, 2.5), (40, None), (50, 2.2)]:
        _checkpoint(tmp_path, step, val)
    assert ckptdir.best(tmp_path) == (20, 2.0)
    assert ckptdir.apply_retention(tmp_path, keep=1) == [10, 30, 40]
    assert ckptdir.complete_steps(tmp_path) == [20, 50]
    _checkpoint(tmp_path, 60, 1.5)  # a new best: the old one may go now
    assert ckptdir.apply_retention(tmp_path, keep=1) == [20, 50]
    assert ckptdir.complete_steps(tmp_path) == [60]


def test_retention_without_recorded_val_losses_is_unchanged(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step)
    (ckptdir.step_dir(tmp_path, 1) / ckptdir.MARKER).write_text("{not json")
    assert ckptdir.best(tmp_path) is None
    assert ckptdir.retention_victims([1, 2, 3], keep=1, best=None) == [1, 2]
    assert ckptdir.retention_victims([1, 2, 3], keep=1, best=2) == [1]
    assert ckptdir.lowest_val_loss({1: 2.0, 3: 2.0, 2: 2.5}) == (3, 2.0)  # a tie: the newer


def test_best_checkpoint_over_the_transport_matches_the_launcher(tmp_path: Path) -> None:
    from meshrun.submit.jobs import checkpoints
    from meshrun.submit.transport.base import LocalTransport

    assert checkpoints.MARKER == ckptdir.MARKER
    transport = LocalTransport()
    assert checkpoints.best_checkpoint(transport, str(tmp_path / "none")) is None
    for step, val in [(5, 4.25), (10, 3.5e-1), (15, None), (20, 1e-3)]:
        _checkpoint(tmp_path, step, val)
    tmp = ckptdir.step_dir(tmp_path, 25).with_suffix(".tmp")  # an unmarked save is no candidate
    tmp.mkdir()
    (tmp / "meshrun-staged.json").write_text('{"val_loss": 0.0001}')
    assert checkpoints.best_checkpoint(transport, str(tmp_path)) == (20, 1e-3) == ckptdir.best(tmp_path)
