"""Checkpoints staged on node-local scratch and copied to shared storage (launcher/sidecar/copier.py).

Real files, real child processes and a real 2-process gloo DCP save; the kill -9 trials are in
tests/integration/test_copier_kills.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from meshrun.launcher.checkpoint import commit as ckpt
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.sidecar import copier

ATTEMPT = "1234.0"


def stage(staging: Path, step: int, node_rank: int, files: dict[str, bytes], attempt: str = ATTEMPT) -> Path:
    """A node's part as the trainer stages it: files, then the staged marker, then the rename."""
    tmp = staging / f"step-{step:08d}.tmp"
    for rel, data in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_bytes(data)
    staging.mkdir(parents=True, exist_ok=True)
    info = {"step": step, "layout": {"dp": 2}}
    marker = {"step": step, "attempt": attempt, "node": f"n{node_rank}", "node_rank": node_rank, "nodes": 2}
    ckptdir.stage(tmp, ckptdir.step_dir(staging, step), {**marker, "info": info})
    return ckptdir.step_dir(staging, step)


def two_nodes(tmp_path: Path, step: int, attempt: str = ATTEMPT) -> tuple[Path, Path, Path]:
    a, b, shared = tmp_path / "a", tmp_path / "b", tmp_path / "shared"
    stage(a, step, 0, {".metadata": b"meta" * 10, "__0_0.distcp": os.urandom(3000)}, attempt)
    stage(b, step, 1, {"__1_0.distcp": os.urandom(5000), "sub/x.bin": b"x" * 7}, attempt)
    return a, b, shared


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_copy_part_copies_verifies_privately_and_writes_the_done_file(tmp_path: Path) -> None:
    a, _b, shared = two_nodes(tmp_path, 10)
    staged = ckptdir.step_dir(a, 10)
    assert copier.copy_part(staged, shared, "n0", 0)
    tmp = copier.shared_tmp(shared, 10)
    assert sorted(p.name for p in tmp.iterdir()) == [".meshrun-nodes", ".metadata", "__0_0.distcp"]
    done = json.loads(copier.done_file(shared, 10, 0).read_text())
    assert done["node"] == "n0" and done["node_rank"] == 0 and done["attempt"] == ATTEMPT
    assert done["files"] == {rel: [(staged / rel).stat().st_size, sha(staged / rel)] for rel in done["files"]}
    assert set(done["files"]) == {".metadata", "__0_0.distcp"} and done["info"]["layout"] == {"dp": 2}
    for rel in done["files"]:
        assert (tmp / rel).read_bytes() == (staged / rel).read_bytes()
        assert (tmp / rel).stat().st_mode & 0o777 == 0o600
    assert tmp.stat().st_mode & 0o777 == 0o700
    assert (staged / copier.COPIED).is_file() and copier.to_copy(a, ATTEMPT) == []
    assert ckptdir.complete_steps(shared) == []  # one node's part is no checkpoint


def test_commit_waits_for_every_node_and_checks_sizes(tmp_path: Path) -> None:
    a, b, shared = two_nodes(tmp_path, 10)
    copier.copy_part(ckptdir.step_dir(a, 10), shared, "n0", 0)
    assert copier.commit_ready(shared, 2, ATTEMPT, keep=3, keep_every=0) == []
    copier.copy_part(ckptdir.step_dir(b, 10), shared, "n1", 1)
    (copier.shared_tmp(shared, 10) / "sub/x.bin").write_bytes(b"x" * 6)  # a file cut short after its check
    assert copier.commit_ready(shared, 2, ATTEMPT, keep=3, keep_every=0) == []
    (copier.shared_tmp(shared, 10) / "sub/x.bin").write_bytes(b"x" * 7)
    assert copier.commit_ready(shared, 2, "other.0", keep=3, keep_every=0) == []  # not this attempt's parts
    assert copier.commit_ready(shared, 2, ATTEMPT, keep=3, keep_every=0) == [10]
    marker = ckptdir.read_marker(ckptdir.step_dir(shared, 10))
    assert marker["step"] == 10 and marker["layout"] == {"dp": 2} and "copied_at" in marker
    final = ckptdir.step_dir(shared, 10)
    for staging in (a, b):
        for rel in copier.part_files(ckptdir.step_dir(staging, 10)):
            assert sha(final / rel) == sha(ckptdir.step_dir(staging, 10) / rel)
    assert not (final / ckptdir.STAGED).exists()
    # A node that copies again as the step commits (it saw neither the marker nor its done file)
    # leaves a twin folder: the next commit round removes it, and keeps the checkpoint.
    copier.copy_part(ckptdir.step_dir(b, 10), shared, "n1", 1)
    assert not copier.shared_tmp(shared, 10).is_dir()  # complete on shared: nothing to copy
    copier.shared_tmp(shared, 10).mkdir()
    assert copier.commit_ready(shared, 2, ATTEMPT, keep=3, keep_every=0) == []
    assert not copier.shared_tmp(shared, 10).exists() and ckptdir.complete_steps(shared) == [10]


def test_commit_applies_retention_on_shared_storage(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    for step in (10, 20, 30):
        a, b = tmp_path / "a", tmp_path / "b"
        stage(a, step, 0, {".metadata": b"m"})
        stage(b, step, 1, {"__1_0.distcp": b"d"})
        copier.copy_part(ckptdir.step_dir(a, step), shared, "n0", 0)
        copier.copy_part(ckptdir.step_dir(b, step), shared, "n1", 1)
        copier.commit_ready(shared, 2, ATTEMPT, keep=2, keep_every=0)
    assert ckptdir.complete_steps(shared) == [20, 30]


def test_a_rerun_redoes_damaged_files_keeps_verified_ones_and_ends_the_same(tmp_path: Path) -> None:
    _a, b, shared = two_nodes(tmp_path, 10)
    staged = ckptdir.step_dir(b, 10)
    copier.copy_part(staged, shared, "n1", 1)
    first = json.loads(copier.done_file(shared, 10, 1).read_text())
    tmp = copier.shared_tmp(shared, 10)
    # As after a kill -9 mid-copy: no done file, no copied mark, one file cut short, one flipped in place.
    copier.done_file(shared, 10, 1).unlink()
    (staged / copier.COPIED).unlink()
    (tmp / "__1_0.distcp").write_bytes((staged / "__1_0.distcp").read_bytes()[:100])
    (tmp / "sub/x.bin").write_bytes(b"y" * 7)
    kept = (tmp / "sub").stat().st_ino
    assert copier.to_copy(b, ATTEMPT) == [10]
    assert copier.copy_part(staged, shared, "n1", 1)
    assert json.loads(copier.done_file(shared, 10, 1).read_text()) == first
    assert (tmp / "sub/x.bin").read_bytes() == b"x" * 7 and (tmp / "sub").stat().st_ino == kept
    verified = (tmp / "__1_0.distcp").stat().st_mtime_ns
    (staged / copier.COPIED).unlink()
    copier.done_file(shared, 10, 1).unlink()
    copier.copy_part(staged, shared, "n1", 1)
    assert (tmp / "__1_0.distcp").stat().st_mtime_ns == verified  # a verified file is not written again


def test_prune_after_commit_and_other_attempts_are_removed_and_reported(tmp_path: Path) -> None:
    a, b, shared = two_nodes(tmp_path, 10)
    stage(a, 5, 0, {".metadata": b"old"}, attempt="999.0")  # an earlier life of the job on this node
    lines: list[str] = []
    assert copier.prune(a, shared, ATTEMPT, lines.append) == [5]
    assert lines == [
        "step 5 exists only on node-local scratch and is lost; resume starts from step 0 (no complete checkpoint)"
        " (staged by attempt 999.0, this is 1234.0)"
    ]
    copier.copy_part(ckptdir.step_dir(a, 10), shared, "n0", 0)
    assert copier.prune(a, shared, ATTEMPT, lines.append) == []  # copied, not yet complete: kept
    copier.copy_part(ckptdir.step_dir(b, 10), shared, "n1", 1)
    copier.commit_ready(shared, 2, ATTEMPT, keep=3, keep_every=0)
    assert copier.prune(a, shared, ATTEMPT, lines.append) == [10]
    assert copier.prune(b, shared, ATTEMPT, lines.append) == [10]
    stage(b, 8, 1, {"x": b"1"}, attempt="999.0")  # another attempt's, older than a complete one
    assert copier.prune(b, shared, ATTEMPT, lines.append) == [8]
    assert lines[-1].startswith("step 8 exists only on node-local scratch and is lost; resume uses step 10")


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_copiers_copy_in_child_processes_commit_and_prune(tmp_path: Path) -> None:
    a, b, shared = two_nodes(tmp_path, 10)
    logs: list[str] = []
    nodes = [
        copier.Copier(str(s), str(shared), f"n{r}", r, 2, ATTEMPT, 3, 0, logs.append) for r, s in enumerate((a, b))
    ]

    def done() -> bool:
        for node in nodes:
            node.tick()
        return ckptdir.complete_steps(shared) == [10] and not ckptdir.staged_steps(a) and not ckptdir.staged_steps(b)

    wait_for(done)
    assert any("step-00000010: this node's part copied to shared storage" in line for line in logs)
    assert "checkpoint step 10 complete on shared storage" in "\n".join(logs)


def test_a_copy_child_takes_no_notice_of_the_batch_scripts_usr2(tmp_path: Path) -> None:
    """The batch script says USR2 every second until the sidecars stop, and Slurm signals every process of the
    sidecars' step: the copy children too, which a USR2 (its default action) would end half way, every second,
    through the whole final copy of a large checkpoint. They start with USR2 blocked."""
    a, _b, shared = two_nodes(tmp_path, 10)
    node = copier.Copier(str(a), str(shared), "n0", 0, 2, ATTEMPT, 3, 0, [].append)
    node.tick()
    assert node.child is not None
    child = node.child
    while child.poll() is None:  # from its first instant (Python starting) to its last
        try:
            os.kill(child.pid, signal.SIGUSR2)
        except ProcessLookupError:
            break
        time.sleep(0.005)
    assert child.wait() == 0
    node.tick()
    assert node.failures == 0 and (ckptdir.step_dir(a, 10) / copier.COPIED).is_file()


def test_a_failed_copy_child_is_logged_and_retried_with_backoff(tmp_path: Path) -> None:
    a, _b, shared = two_nodes(tmp_path, 10)
    shared.write_text("not a folder")  # the child fails (as on an unreachable shared file system)
    logs: list[str] = []
    node = copier.Copier(str(a), str(shared), "n0", 0, 2, ATTEMPT, 3, 0, logs.append)
    node.tick()
    wait_for(lambda: node.child is not None and node.child.poll() is not None)
    node.tick()
    assert node.child is None and node.failures == 1
    assert "copying step 10 failed (copier: " in logs[-1] and logs[-1].endswith("retrying in 1 s")
    shared.unlink()
    # The retry succeeds: the child marks the step copied, and the tick that sees it exit resets the count.
    wait_for(lambda: (node.tick(), node.failures == 0 and (ckptdir.step_dir(a, 10) / copier.COPIED).is_file())[1])


def test_drain_copies_what_is_left_and_reports_what_it_could_not(tmp_path: Path) -> None:
    a, b, shared = two_nodes(tmp_path, 10)
    stage(a, 20, 0, {".metadata": b"m20"})
    stage(b, 20, 1, {"__1_0.distcp": b"d20"})
    logs: list[str] = []
    one = copier.Copier(str(b), str(shared), "n1", 1, 2, ATTEMPT, 3, 0, logs.append)
    assert one.drain(time.monotonic() + 30) == []  # node 1: its parts are on shared storage
    stage(a, 30, 0, {".metadata": b"m30"})  # node 1 never staged step 30 (say, it died)
    zero = copier.Copier(str(a), str(shared), "n0", 0, 2, ATTEMPT, 3, 0, logs.append)
    # node 1's sidecar is gone: node 0 copies step 20 and stops waiting for step 30 (no 2 s deadline to beat: under
    # a suite's load the copy of step 20 outlasted one, and step 20 was reported lost too)
    assert zero.drain(time.monotonic() + 60, gone=lambda: {1}) == [30]
    assert ckptdir.complete_steps(shared) == [10, 20]
    assert logs[-1] == "step 30 exists only on node-local scratch and is lost; resume uses step 20"


def test_the_cli_refuses_bad_arguments_in_one_line() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "meshrun.launcher.sidecar.copier", "copy", "x"], capture_output=True, text=True
    )
    assert run.returncode == 2 and run.stderr.startswith("usage: python -m meshrun.launcher.sidecar.copier copy")
    assert copier.main(["run", "s", "d", "n", "zero", "2", "a", "3", "0", "5"]) == 2


# A real save on two ranks (gloo), each rank its own "node" with its own scratch.
RANK = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from pathlib import Path
    from meshrun.launcher.checkpoint import commit as ckpt
    rank, store, scratch, shared = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    staged = []
    saver = ckpt.Checkpointer(shared, keep=1, async_save=bool(rank), coordinator=rank == 0,
                              on_commit=lambda step, stall: staged.append(step), stage_root=scratch / f"node{rank}",
                              node_coordinator=True, attempt="77.0", nodes=2, node_rank=rank)
    saver.prepare()
    for step in (3, 4):
        state = {"model": model.state_dict(), f"rank{rank}": torch.full((4,), float(rank + step))}
        saver.save(step, ckpt.dcp_writer(saver, state), {"w": 2})
    saver.close()
    assert staged == [3, 4] and saver.last_committed == 4, staged
    assert not shared.exists() or not list(shared.iterdir()), "the trainer writes nothing to shared storage"
    dist.destroy_process_group()
    """
)


def test_a_two_rank_save_staged_on_two_nodes_ends_complete_on_shared_and_loads(tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist

    scratch, shared = tmp_path / "scratch", tmp_path / "shared"
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "store"), str(scratch), str(shared)])
        for r in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    for rank in (0, 1):
        marker = ckptdir.read_marker(ckptdir.step_dir(scratch / f"node{rank}", 4), ckptdir.STAGED)
        assert (marker["attempt"], marker["node_rank"], marker["nodes"]) == ("77.0", rank, 2)
        assert marker["info"]["w"] == 2 and marker["info"]["step"] == 4
    assert (ckptdir.step_dir(scratch / "node0", 4) / ".metadata").is_file()
    assert not (ckptdir.step_dir(scratch / "node1", 4) / ".metadata").exists()
    nodes = [copier.Copier(str(scratch / f"node{r}"), str(shared), f"n{r}", r, 2, "77.0", 1, 0, print) for r in (0, 1)]
    assert nodes[1].drain(time.monotonic() + 60) == []  # node 1 first: node 0's commit must see both parts
    assert nodes[0].drain(time.monotonic() + 60) == []
    assert ckptdir.complete_steps(shared) == [4]  # retention (keep 1) on shared storage
    nodes[1].tick()  # node 1 prunes once the step is complete on shared storage
    assert not ckptdir.staged_steps(scratch / "node0") and not ckptdir.staged_steps(scratch / "node1")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        expected = torch.nn.Linear(32, 16).state_dict()
        state = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}}
        state |= {"rank0": torch.zeros(4), "rank1": torch.zeros(4)}
        marker = ckpt.Checkpointer(shared, keep=1).dcp_load(state, ckptdir.step_dir(shared, 4))
    finally:
        dist.destroy_process_group()
    assert marker["step"] == 4 and marker["w"] == 2
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())
    assert torch.equal(state["rank0"], torch.full((4,), 4.0)) and torch.equal(state["rank1"], torch.full((4,), 5.0))


def test_a_staged_save_on_one_process_goes_to_scratch_only(tmp_path: Path) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        scratch, shared = tmp_path / "scratch", tmp_path / "shared"
        (scratch / "step-00000001.tmp").mkdir(parents=True)  # an interrupted save of an earlier life
        saver = ckpt.Checkpointer(shared, keep=1, stage_root=scratch, attempt="5.1")
        saver.prepare()
        assert not (scratch / "step-00000001.tmp").exists() and shared.is_dir()
        for step in (2, 3):
            saver.save(step, ckpt.dcp_writer(saver, {"t": torch.arange(5) + step}), {"k": "v"})
        saver.close()
    finally:
        dist.destroy_process_group()
    assert ckptdir.staged_steps(scratch) == [2, 3] and ckptdir.complete_steps(shared) == []
    assert ckptdir.read_marker(ckptdir.step_dir(scratch, 3), ckptdir.STAGED)["node_rank"] == 0
    assert (scratch.stat().st_mode & 0o777, ckptdir.step_dir(scratch, 3).stat().st_mode & 0o777) == (0o700, 0o700)
