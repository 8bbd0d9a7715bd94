"""Checkpoints staged on node-local scratch, copied to shared storage by each node's sidecar.

The trainer stages each node's part of a save on that node's scratch (launcher/checkpoint/commit.py:
`STAGE/step-N/` with `meshrun-staged.json` written last). Here, on every node:

- copy: a child process (`python -m meshrun.launcher.sidecar.copier copy ...`) copies the node's part
  into `SHARED/step-N.tmp/` (launcher/sidecar/copyfile.py): per file a streamed copy hashed on
  the way (sha256), fsync, and a check of the destination (its size, and its bytes read back
  against the source; files in parallel); then the node's done file
  `SHARED/step-N.tmp/.meshrun-nodes/<node_rank>.json` (tmp + fsync + rename) and, on scratch,
  `meshrun-copied.json`. A child killed half way is simply run again: files whose copy does not
  verify are redone, verified ones are kept.
- commit (node rank 0 only): when all nodes' done files of this attempt are there and every file
  they list has its size, the usual commit (marker last, fsync, rename to `SHARED/step-N`), then
  retention on shared storage. Nothing else ever marks a checkpoint there, so shared storage
  holds complete checkpoints or unmarked folders, never a marked partial one.
- prune: a staged step leaves scratch once it is complete on shared storage (or, copied, it was
  already retained away or superseded there). A step staged by another attempt (an earlier life
  of the job on this node) is never copied, since the other nodes' parts are gone: it is removed,
  and the log says it is lost unless shared storage has it.

Torch-free and stdlib only: the sidecar runs it beside the ranks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from meshrun.launcher.contract import private
from meshrun.launcher.contract.exitcodes import EXIT_FAILED, EXIT_INPUT
from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.sidecar.copyfile import CopyError, copy_file, hash_file, same_bytes
from meshrun.launcher.sidecar.keeper import popen_blocking

COPIED = "meshrun-copied.json"
"""On scratch, in a staged step: this node's part is verified on shared storage."""
NODES_DIR = ".meshrun-nodes"
"""In `SHARED/step-N.tmp/`: one done file per node (kept in the checkpoint: its files' checksums)."""
MAX_WORKERS = 8
"""Files copied at once (a node's part has a file per rank): hashing and I/O spread over cores."""
RETRY_MAX_S = 30.0
"""The longest wait before a failed copy is tried again (the backoff doubles from 1 s)."""
GONE_POLL_S = 2.0
"""At the end, how often node rank 0 reads whether the other nodes' sidecars are gone."""
PARENT_ENV = "MESHRUN_COPIER_PARENT"
"""The sidecar's pid, given to its copy child: the child dies with it (die_with_parent)."""
LogFn = Callable[[str], None]


def die_with_parent() -> bool:
    """Have Linux SIGKILL this copy child when its sidecar dies (PR_SET_PDEATHSIG), and say whether that
    sidecar is still its parent. A restarted sidecar copies the same step again: two copies of one step
    at once must never race on its files, so an orphaned copy child never goes on."""
    expected = os.environ.get(PARENT_ENV)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
    except (OSError, AttributeError):
        pass  # not Linux: the check below still catches a sidecar already gone
    return expected is None or str(os.getppid()) == expected


def part_files(staged: Path) -> list[str]:
    """This node's files of a staged step, relative, sorted; the scratch-only markers left out."""
    files = []
    for parent, _dirs, names in os.walk(staged):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), staged)
            if rel not in (ckptdir.STAGED, COPIED):
                files.append(rel)
    return sorted(files)


def shared_tmp(shared_root: Path, step: int) -> Path:
    return Path(shared_root) / f"step-{step:08d}.tmp"


def done_file(shared_root: Path, step: int, node_rank: int) -> Path:
    return shared_tmp(shared_root, step) / NODES_DIR / f"{node_rank}.json"


def read_json(path: Path) -> Optional[dict[str, Any]]:
    """A JSON object file, or None when missing, partial or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _sizes_match(folder: Path, files: dict[str, Any]) -> bool:
    try:
        return all((folder / rel).stat().st_size == int(entry[0]) for rel, entry in files.items())
    except (OSError, ValueError, TypeError, IndexError):
        return False


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    private.write_private(tmp, json.dumps(data, sort_keys=True), fsync=True)
    os.rename(tmp, path)
    ckptdir.fsync_dir(path.parent)


def copy_part(staged_step_dir: Path, shared_root: Path, node: str, node_rank: int) -> bool:
    """Copy, fsync and verify this node's part of a staged step into `SHARED/step-N.tmp/`, then write
    its done file. True once the part is verified on shared storage (or the step is complete there);
    a file that does not verify raises CopyError, an I/O failure OSError (the caller retries)."""
    staged = Path(staged_step_dir)
    marker = ckptdir.read_marker(staged, ckptdir.STAGED)
    step, attempt = int(marker["step"]), str(marker["attempt"])
    if (ckptdir.step_dir(shared_root, step) / ckptdir.MARKER).is_file():
        return True
    tmp, done = shared_tmp(shared_root, step), done_file(shared_root, step, node_rank)
    previous = read_json(done)
    if previous and previous.get("attempt") == attempt and _sizes_match(tmp, previous.get("files", {})):
        _mark_copied(staged, previous)
        return True
    private.make_private_dir(tmp)
    private.make_private_dir(done.parent)
    done.unlink(missing_ok=True)  # from here until the new one, this node's part is not done
    rels = part_files(staged)
    workers = max(1, min(len(rels), os.cpu_count() or 1, MAX_WORKERS))
    with ThreadPoolExecutor(workers) as files_pool, ThreadPoolExecutor(workers) as hash_pool:
        sums = files_pool.map(lambda rel: _copy_verified(staged / rel, tmp / rel, tmp, hash_pool), rels)
        files = {rel: list(result) for rel, result in zip(rels, sums)}
    record = {"node": node, "node_rank": node_rank, "attempt": attempt, "step": step, "files": files}
    if node_rank == 0:
        record["info"] = marker.get("info", {})  # what the commit's marker says (the trainer's info)
    _write_atomic(done, record)
    _mark_copied(staged, record)
    return True


def _copy_verified(src: Path, dst: Path, tmp: Path, pool: ThreadPoolExecutor) -> tuple[int, str]:
    """One file: kept when it is already there and verifies, else copied, fsynced and read back."""
    if dst.parent != tmp:
        private.make_private_dir(dst.parent)
    if dst.is_file() and same_bytes(src, dst):
        fd = os.open(dst, os.O_RDONLY)
        try:
            os.fsync(fd)  # a copier killed after writing it may have died before its fsync
        finally:
            os.close(fd)
        return hash_file(src, pool)
    return copy_file(src, dst, pool)


def _mark_copied(staged: Path, record: dict[str, Any]) -> None:
    private.write_private(staged / COPIED, json.dumps({"time": time.time(), "files": len(record.get("files", {}))}))


def ready(shared_root: Path, step: int, nodes: int, attempt: str) -> Optional[dict[str, Any]]:
    """The marker info when every node's done file of `attempt` is there and every file it lists has
    its size; else None."""
    tmp = shared_tmp(shared_root, step)
    info: Optional[dict[str, Any]] = None
    for node_rank in range(nodes):
        record = read_json(tmp / NODES_DIR / f"{node_rank}.json")
        if not record or record.get("attempt") != attempt or not _sizes_match(tmp, record.get("files", {})):
            return None
        if node_rank == 0:
            info = dict(record.get("info") or {})
    return info


def commit_ready(shared_root: Path, nodes: int, attempt: str, keep: int, keep_every: int) -> list[int]:
    """Commit every step whose parts are all verified on shared storage; then retention. Returns them."""
    committed = []
    for entry in sorted(Path(shared_root).glob("step-*.tmp")):
        step = int(entry.name[len("step-") : -len(".tmp")])
        if (ckptdir.step_dir(shared_root, step) / ckptdir.MARKER).is_file():
            # A late copier recreated the folder just as the step committed: a leftover, never needed.
            shutil.rmtree(entry, ignore_errors=True)
            continue
        info = ready(shared_root, step, nodes, attempt)
        if info is None:
            continue
        ckptdir.commit(entry, ckptdir.step_dir(shared_root, step), {**info, "step": step, "copied_at": time.time()})
        committed.append(step)
    if committed:
        # Imported here: the copy child (one process per staged step) never commits, and starts ~10 ms sooner.
        from meshrun.launcher.checkpoint import resume

        resume.progress_made(Path(shared_root))  # a newer complete checkpoint: the crash-loop guard resets
        ckptdir.apply_retention(Path(shared_root), keep, keep_every)
    return committed


def staged_attempt(staged: Path) -> Optional[str]:
    marker = read_json(staged / ckptdir.STAGED)
    return str(marker["attempt"]) if marker and "attempt" in marker else None


def lost_note(shared_root: Path, step: int) -> str:
    newest = ckptdir.complete_steps(shared_root)
    resume = f"resume uses step {newest[-1]}" if newest else "resume starts from step 0 (no complete checkpoint)"
    return f"step {step} exists only on node-local scratch and is lost; {resume}"


def prune(staging: Path, shared_root: Path, attempt: str, log: LogFn, busy: Optional[int] = None) -> list[int]:
    """Remove staged steps that are safe on shared storage, and every step of another attempt."""
    removed = []
    complete = ckptdir.complete_steps(shared_root)
    for step in ckptdir.staged_steps(staging):
        staged = ckptdir.step_dir(staging, step)
        owner = staged_attempt(staged)
        if step == busy and owner == attempt:
            continue
        if owner != attempt:
            if step not in complete:
                log(f"{lost_note(shared_root, step)} (staged by attempt {owner}, this is {attempt})")
        elif not (step in complete or ((staged / COPIED).is_file() and complete and complete[-1] >= step)):
            continue
        shutil.rmtree(staged, ignore_errors=True)
        removed.append(step)
    return removed


def to_copy(staging: Path, attempt: str) -> list[int]:
    """This attempt's staged steps whose part is not yet on shared storage, oldest first."""
    steps = []
    for step in ckptdir.staged_steps(staging):
        staged = ckptdir.step_dir(staging, step)
        if staged_attempt(staged) == attempt and not (staged / COPIED).is_file():
            steps.append(step)
    return steps


class Copier:
    """One node's copier, driven by the sidecar: `tick()` about every second, `drain()` at stop."""

    def __init__(
        self,
        staging: str,
        shared_root: str,
        node: str,
        node_rank: int,
        nodes: int,
        attempt: str,
        keep: int,
        keep_every: int,
        log: LogFn,
        on_commit: Optional[Callable[[int], None]] = None,
    ) -> None:
        """`on_commit(step)`: node rank 0's news of a step complete on shared storage (the run's metrics)."""
        self.on_commit = on_commit
        self.staging, self.shared = Path(staging), Path(shared_root)
        self.node, self.node_rank, self.nodes, self.attempt = node, node_rank, nodes, attempt
        self.keep, self.keep_every, self.log = keep, keep_every, log
        self.child: Optional[subprocess.Popen[bytes]] = None
        self.child_step: Optional[int] = None
        self.child_started = 0.0
        self.failures = 0
        self.next_try = 0.0

    def tick(self) -> None:
        """Reap the copy child, commit (node rank 0), prune, and start the next copy if none runs."""
        self._reap()
        if self.node_rank == 0:
            for step in commit_ready(self.shared, self.nodes, self.attempt, self.keep, self.keep_every):
                self.log(f"checkpoint step {step} complete on shared storage ({self.shared})")
                if self.on_commit is not None:
                    self.on_commit(step)
        prune(self.staging, self.shared, self.attempt, self.log, busy=self.child_step)
        if self.child is None and time.monotonic() >= self.next_try:
            pending = to_copy(self.staging, self.attempt)
            if pending:
                self._start(pending[0])

    def _start(self, step: int) -> None:
        argv = [sys.executable, "-m", "meshrun.launcher.sidecar.copier", "copy"]
        argv += [str(ckptdir.step_dir(self.staging, step)), str(self.shared), self.node, str(self.node_rank)]
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        # USR2 blocked for good: it means "the ranks have ended" to the sidecar, and the batch script says it every
        # second until the sidecars stop, to every process of their step (this child too, and what it runs): its
        # default action would end the copy half way, again and again, through the whole final copy.
        self.child = popen_blocking(
            (signal.SIGUSR2,),
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        self.child_step, self.child_started = step, time.monotonic()

    def _reap(self) -> None:
        if self.child is None or self.child.poll() is None:
            return
        child, step = self.child, self.child_step
        self.child, self.child_step = None, None
        output = (child.stdout.read() if child.stdout else b"").decode(errors="replace").strip()
        if child.stdout:
            child.stdout.close()
        if child.returncode == 0:
            self.failures = 0
            self.log(output or f"step {step}: this node's part copied to shared storage")
            return
        self.failures += 1
        backoff = min(2.0 ** (self.failures - 1), RETRY_MAX_S)
        self.next_try = time.monotonic() + backoff
        why = output.splitlines()[-1] if output else f"exit {child.returncode}"
        self.log(f"copying step {step} failed ({why}); retrying in {backoff:g} s")

    def stop_child(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.wait()
            if self.child.stdout:
                self.child.stdout.close()
            self.child, self.child_step = None, None

    def missing_from(self, steps: list[int], gone: set[int]) -> list[int]:
        """The gone node ranks whose parts some of `steps` lack, if every one of `steps` lacks such a part
        (this node's own part copied); else [] (something may still arrive)."""
        blocking: set[int] = set()
        own = set(to_copy(self.staging, self.attempt))
        for step in steps:
            lacking = {rank for rank in gone if not done_file(self.shared, step, rank).is_file()}
            if not lacking or step in own:
                return []
            blocking |= lacking
        return sorted(blocking)

    def left(self) -> list[int]:
        """Steps of this attempt not yet safe: not copied (any node), or not committed (node rank 0)."""
        if self.node_rank != 0:
            return to_copy(self.staging, self.attempt)
        complete = set(ckptdir.complete_steps(self.shared))
        return [
            step
            for step in ckptdir.staged_steps(self.staging)
            if step not in complete and staged_attempt(ckptdir.step_dir(self.staging, step)) == self.attempt
        ]

    def drain(
        self,
        deadline: float,
        poll_s: float = 0.2,
        gone: Callable[[], set[int]] = set,
        on_poll: Callable[[], None] = lambda: None,
    ) -> list[int]:
        """At stop: copy (and on node rank 0 commit) what is left until `deadline` (time.monotonic());
        returns the steps still only on scratch, each logged as lost. `gone()`: the node ranks whose
        sidecar has stopped or died; node rank 0 stops waiting once every step left lacks one of their
        parts (they will never come: the job must not hold its nodes for sidecar.final_copy_s for nothing).
        `on_poll`: called every poll (the sidecar's liveness stamp)."""
        asked = 0.0
        while True:
            self.tick()
            on_poll()
            left = self.left()
            if not left and self.child is None:
                return []
            if time.monotonic() >= deadline:
                break
            waiting_for: list[int] = []
            if self.node_rank == 0 and self.child is None and time.monotonic() >= asked + GONE_POLL_S:
                asked = time.monotonic()  # the other nodes' stamps are files on shared storage: not every poll
                waiting_for = self.missing_from(left, gone())
            if waiting_for:
                self.log(
                    f"node rank(s) {', '.join(map(str, waiting_for))} stopped copying: not waiting for their parts"
                )
                break
            time.sleep(poll_s)
        self.stop_child()
        for step in left:
            self.log(lost_note(self.shared, step))
        return left


USAGE = """usage: python -m meshrun.launcher.sidecar.copier copy STAGED_STEP_DIR SHARED_ROOT NODE NODE_RANK
       python -m meshrun.launcher.sidecar.copier run STAGING SHARED_ROOT NODE NODE_RANK NODES ATTEMPT KEEP KEEP_EVERY SECONDS"""


def main(argv: Optional[list[str]] = None) -> int:
    """`copy`: one node's part of one step (the sidecar's child); `run`: a whole node's drain (tests, srun)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["copy"] and len(argv) == 5:
            return _copy_one(Path(argv[1]), Path(argv[2]), argv[3], int(argv[4]))
        if argv[:1] == ["run"] and len(argv) == 10:
            staging, shared, node, node_rank, nodes, attempt, keep, every, seconds = argv[1:]
            copier = Copier(staging, shared, node, int(node_rank), int(nodes), attempt, int(keep), int(every), _stderr)
            deadline = time.monotonic() + float(seconds)
            return 0 if not copier.drain(deadline) else EXIT_FAILED
    except ValueError as exc:  # only the numbers in argv raise it here
        print(f"copier: {exc}\n{USAGE}", file=sys.stderr)
        return EXIT_INPUT
    print(USAGE, file=sys.stderr)
    return EXIT_INPUT


def _copy_one(staged: Path, shared: Path, node: str, node_rank: int) -> int:
    if not die_with_parent():
        print("copier: its sidecar is gone: not copying", flush=True)
        return EXIT_FAILED
    began = time.monotonic()
    try:
        copy_part(staged, shared, node, node_rank)
        size = sum((staged / rel).stat().st_size for rel in part_files(staged))
    except (OSError, ValueError, KeyError, CopyError, ckptdir.CheckpointError) as exc:
        print(f"copier: {type(exc).__name__}: {exc}", flush=True)  # one line for the sidecar's log
        return EXIT_FAILED
    rate = size / 1e6 / max(time.monotonic() - began, 1e-9)
    print(f"{staged.name}: this node's part copied to shared storage ({size / 1e6:.1f} MB, {rate:.0f} MB/s)")
    return 0


def _stderr(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
