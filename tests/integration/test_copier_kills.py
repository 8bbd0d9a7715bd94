"""kill -9 the checkpoint copier at random moments: shared storage never holds a marked partial checkpoint.

Two "nodes" (two staging folders, node ranks 0 and 1) each with its part of a staged checkpoint
of a few MB; both nodes' copiers (`python -m meshrun.launcher.sidecar.copier run ...`, each in its own
session with its copy child, as a node's processes are) start together, one node's is killed
with SIGKILL after a random delay, then the other's too if it is still running. Throughout, every
checkpoint that shows up marked on shared storage must hold exactly the sources' files, byte for
byte (sha256). Then both copiers run again and must complete the checkpoint.

The same trials run on the real 2-node Slurm testbed, each node's copier started by
`srun -N2 --ntasks-per-node=1` on its own node (n1, n2).

3 local trials and 2 on the testbed in CI; MESHRUN_SOAK=1 runs 20 of each (the issue's soak
count). The seed of each trial is in its id, so a failing trial reruns the same delays. A copier
that writes its done file before copying (a deliberate bug) fails about 5 of 20 local trials and
16 of 20 on the testbed.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.sidecar import copier
from tests.helpers.cli import trials

TRIALS = trials(3)
ATTEMPT = "4242.0"
STEP = 100
PARTS = {  # node rank -> {file: size}: a few MB per node, several files each
    0: {".metadata": 20_000, "__0_0.distcp": 1_500_000, "__0_1.distcp": 900_000},
    1: {"__1_0.distcp": 1_400_000, "__1_1.distcp": 1_100_000, "nested/__1_2.distcp": 300_000},
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stage_nodes(root: Path, rng: random.Random) -> dict[str, str]:
    """Stage both nodes' parts; returns every source file's sha256 by relative path."""
    sources = {}
    for node_rank, files in PARTS.items():
        tmp = root / f"node{node_rank}" / f"step-{STEP:08d}.tmp"
        for rel, size in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(rng.randbytes(size))
            sources[rel] = sha(tmp / rel)
        marker = {"step": STEP, "attempt": ATTEMPT, "node_rank": node_rank, "nodes": 2, "info": {"step": STEP}}
        ckptdir.stage(tmp, ckptdir.step_dir(root / f"node{node_rank}", STEP), marker)
    return sources


def start(root: Path, node_rank: int, seconds: float) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "meshrun.launcher.sidecar.copier", "run", str(root / f"node{node_rank}")]
    argv += [str(root / "shared"), f"n{node_rank}", str(node_rank), "2", ATTEMPT, "3", "0", str(seconds)]
    return subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_node(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the node's copier and its copy child together (its session), as a node dies."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def check_marked(shared: Path, sources: dict[str, str], seen: dict[int, str]) -> None:
    """Every marked checkpoint holds exactly the sources' files with their checksums."""
    for step in ckptdir.complete_steps(shared):
        if step in seen:
            continue
        final = ckptdir.step_dir(shared, step)
        held = {
            str(path.relative_to(final)): sha(path)
            for path in final.rglob("*")
            if path.is_file() and path.name != ckptdir.MARKER and copier.NODES_DIR not in path.parts
        }
        seen[step] = "ok" if held == sources else f"marked partial checkpoint: {sorted(held)} != {sorted(sources)}"


def wait_for_copy(shared: Path, node_rank: int, seconds: float = 5.0) -> None:
    """Until the node's first file shows up on shared storage (its copy has begun)."""
    first = shared / f"step-{STEP:08d}.tmp" / sorted(PARTS[node_rank])[0]
    deadline = time.monotonic() + seconds
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.002)


class Watcher(threading.Thread):
    """Checks shared storage while the copiers run, so that no moment goes unwatched for long."""

    def __init__(self, shared: Path, sources: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.shared, self.sources, self.seen = shared, sources, {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            check_marked(self.shared, self.sources, self.seen)
            self.halt.wait(0.01)


@pytest.mark.parametrize("seed", range(TRIALS))
def test_a_killed_copier_never_leaves_a_marked_partial_checkpoint_and_a_rerun_completes(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    sources = stage_nodes(tmp_path, rng)
    shared = tmp_path / "shared"
    watcher = Watcher(shared, sources)
    watcher.start()
    try:
        procs = {rank: start(tmp_path, rank, seconds=20) for rank in (0, 1)}
        victim = rng.choice((0, 1))
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, 0.6))  # python start-up, the copy child, the copy, the commit (~0.5 s)
        else:  # the copy itself is a short window: aim inside it
            wait_for_copy(shared, victim)
            time.sleep(rng.uniform(0.0, 0.05))
        kill_node(procs[victim])
        try:
            procs[1 - victim].wait(timeout=rng.uniform(0.0, 1.5))
        except subprocess.TimeoutExpired:
            kill_node(procs[1 - victim])  # node 0 waits for node 1's part: a dead node 1 never sends it
        for proc in procs.values():
            assert proc.stderr is not None
            proc.stderr.close()
        check_marked(shared, sources, watcher.seen)
        assert all(verdict == "ok" for verdict in watcher.seen.values()), watcher.seen
        # The next life of the sidecars: both copiers again, to the end.
        reruns = {rank: start(tmp_path, rank, seconds=60) for rank in (1, 0)}
        for rank, proc in reruns.items():
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, f"node {rank}: {err.decode()}"
    finally:
        watcher.halt.set()
        watcher.join()
    check_marked(shared, sources, watcher.seen)
    assert watcher.seen == {STEP: "ok"}
    assert not ckptdir.staged_steps(tmp_path / "node0")  # node 0 committed, then pruned its part
    assert not list(shared.glob("*.tmp"))


NODE_SCRIPT = """
set -m  # the copier gets its own process group: the kill takes its copy child too, as a node's death does
node=$SLURM_NODEID
secs=$([ "$node" = 0 ] && echo "$SECS0" || echo "$SECS1")
"$PY" -m meshrun.launcher.sidecar.copier run "$ROOT/node$node" "$ROOT/shared" "$SLURMD_NODENAME" "$node" 2 "$ATTEMPT" 3 0 "$secs" &
pid=$!
if [ "$node" = "$VICTIM" ]; then
  # Aimed trials wait for the victim's copy to begin (its first file on shared storage), then the delay.
  if [ -n "$FIRST" ]; then for _ in $(seq 2500); do [ -e "$FIRST" ] && break; sleep 0.002; done; fi
  sleep "$DELAY"; kill -KILL -- "-$pid" 2>/dev/null
fi
wait "$pid"
true
"""


def srun_copiers(root: Path, victim: int, delay: float, seconds: tuple[float, float], aim: bool = False) -> None:
    env = dict(os.environ, PY=sys.executable, ROOT=str(root), ATTEMPT=ATTEMPT, VICTIM=str(victim), FIRST="")
    if aim:
        env["FIRST"] = str(root / "shared" / f"step-{STEP:08d}.tmp" / sorted(PARTS[victim])[0])
    env |= {"DELAY": f"{delay:.3f}", "SECS0": str(seconds[0]), "SECS1": str(seconds[1])}
    done = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "--time=2", "bash", "-c", NODE_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


TESTBED_TRIALS = trials(2)


@pytest.mark.parametrize("seed", range(TESTBED_TRIALS))
def test_on_two_slurm_nodes_a_killed_copier_leaves_no_marked_partial_checkpoint(
    testbed: dict[str, object], tmp_path: Path, seed: int
) -> None:
    """The same trial with each node's copier started by srun on its own Slurm node (n1, n2)."""
    rng = random.Random(1000 + seed)
    sources = stage_nodes(tmp_path, rng)
    shared = tmp_path / "shared"
    watcher = Watcher(shared, sources)
    watcher.start()
    try:
        if rng.random() < 0.5:
            srun_copiers(tmp_path, rng.choice((0, 1)), delay=rng.uniform(0.0, 0.6), seconds=(1.5, 20))
        else:  # aimed inside the copy window
            srun_copiers(tmp_path, rng.choice((0, 1)), delay=rng.uniform(0.0, 0.05), seconds=(1.5, 20), aim=True)
        check_marked(shared, sources, watcher.seen)
        assert all(verdict == "ok" for verdict in watcher.seen.values()), watcher.seen
        srun_copiers(tmp_path, victim=-1, delay=0, seconds=(30, 30))
    finally:
        watcher.halt.set()
        watcher.join()
    check_marked(shared, sources, watcher.seen)
    assert watcher.seen == {STEP: "ok"}
    assert not list(shared.glob("*.tmp"))
    done = ckptdir.step_dir(shared, STEP) / copier.NODES_DIR
    assert {copier.read_json(done / f"{rank}.json")["node"] for rank in (0, 1)} == {"n1", "n2"}  # two Slurm nodes
