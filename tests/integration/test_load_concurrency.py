"""Load and concurrency, through the real CLI and real processes: ten `meshrun submit` at once
(local and the Slurm testbed) record each job exactly once; a registry writer SIGKILLed mid-write loses
nothing already recorded; `status` of 1,000 jobs is one remote command; `logs -f` of a 1 GB log reads its
tail, not the gigabyte."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import IO, Any

from meshrun.submit.core.registry import JobRecord, Registry
from tests.helpers import builders, sshbed
from tests.helpers.cli import REPO, env_for, meshrun, submitted, trials

CONCURRENT = 10
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def _registry(home: Path) -> Path:
    return home / "state" / "meshrun" / "registry.sqlite"


def _project(home: Path, argv: list[str]) -> Path:
    """A fresh project (its own code snapshot: concurrent submits to Slurm race to upload it) with job.yaml."""
    files = {"job.yaml": sshbed.command_spec("load", argv), "unique.py": f"# {uuid.uuid4().hex}\n"}
    return sshbed.project(home, files) / "job.yaml"


def _submit_together(home: Path, spec: Path, cluster: str) -> list[tuple[str, Path]]:
    """CONCURRENT real `meshrun submit` processes, all started before the first one ends."""
    argv = [sys.executable, "-m", "meshrun.submit.cli.main", "submit", str(spec), "-c", cluster]
    env = env_for(home)
    procs = [
        subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(CONCURRENT)
    ]
    overlapped = all(p.poll() is None for p in procs)
    outs = [p.communicate(timeout=180) for p in procs]
    assert overlapped, "a submit ended before the last one started: they did not run together"
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, out + err
    return [submitted(subprocess.CompletedProcess(argv, 0, out, err)) for out, err in outs]


def _check_registry(home: Path, jobs: list[tuple[str, Path]], cluster: str, listed: bool = True) -> None:
    """The sqlite file is sound and holds each job exactly once; `status --json` lists each once (`listed`)."""
    ids = [job_id for job_id, _ in jobs]
    assert len(set(ids)) == CONCURRENT, ids
    db = sqlite3.connect(_registry(home))
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = db.execute("SELECT job_id, cluster, run_dir FROM jobs").fetchall()
    finally:
        db.close()
    assert Counter((r[0], r[1]) for r in rows) == Counter((i, cluster) for i in ids), rows
    assert {r[2] for r in rows} == {str(d) for _, d in jobs}  # ten run dirs, none shared
    if not listed:
        return
    found = json.loads(meshrun(home, "status", "-n", "1000", "--json", check=True).stdout)
    assert sorted(r["job_id"] for r in found) == sorted(ids)
    assert all(Path(r["run_dir"]).is_dir() and (Path(r["run_dir"]) / "spec.json").is_file() for r in found)


def _wait_all(home: Path, ids: list[str]) -> list[dict[str, Any]]:
    """`status ID... --watch --json` until every job ended: the last refresh."""
    out = meshrun(home, "status", *ids, "--watch", "--json", timeout=240, check=True)
    rows: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return rows


def test_ten_submits_at_once_on_local_record_each_job_once(tmp_path: Path) -> None:
    jobs = _submit_together(tmp_path, _project(tmp_path, ["true"]), "local")
    _check_registry(tmp_path, jobs, "local", listed=False)
    rows = _wait_all(tmp_path, [j for j, _ in jobs])
    assert sorted(r["job_id"] for r in rows) == sorted(j for j, _ in jobs)
    assert {r["state"] for r in rows} == {"COMPLETED"}, rows
    _check_registry(tmp_path, jobs, "local")  # and after status's state writes


def test_ten_submits_at_once_on_slurm_record_each_job_once(testbed: dict[str, object], tmp_path: Path) -> None:
    jobs = _submit_together(tmp_path, _project(tmp_path, ["true"]), "testbed")
    _check_registry(tmp_path, jobs, "testbed", listed=False)
    rows = _wait_all(tmp_path, [j for j, _ in jobs])
    assert {r["state"] for r in rows} == {"COMPLETED"}, rows  # each id is a real Slurm job that ran
    assert len({r["job_id"] for r in rows}) == CONCURRENT
    _check_registry(tmp_path, jobs, "testbed")


# ------------------------------------------------------------------ SIGKILL during registry writes

# Adds records (and updates each once, as `status` does) in a loop, printing each id once committed.
WRITER = """
import sys, time
from meshrun.submit.core.registry import JobRecord, Registry
registry, trial = Registry(), sys.argv[1]
for i in range(1_000_000):
    record = JobRecord(f"w{trial}-{i}", "local", "writer", f"/nonexistent/w{trial}-{i}", "local", time.time(),
                       None, "0" * 64)
    registry.add(record)
    registry.set_state(record, "RUNNING")
    print(record.job_id, flush=True)
"""


def _kill_writer_midway(home: Path, trial: int, rng: random.Random) -> list[str]:
    """Start WRITER, let it commit a random number of records, SIGKILL it a random moment later;
    the ids it reported committed."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(trial)], cwd=REPO, env=env_for(home), stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    committed = [writer.stdout.readline().strip() for _ in range(rng.randint(1, 40))]
    time.sleep(rng.uniform(0, 0.02))  # lands anywhere in a write: most of the loop's time is in commits
    writer.kill()
    writer.wait()
    committed += [line.strip() for line in writer.stdout]  # what it printed before it died
    writer.stdout.close()
    return [c for c in committed if c]


def test_sigkill_during_registry_writes_loses_nothing_recorded(tmp_path: Path) -> None:
    rng = random.Random(1300)
    first, _ = submitted(meshrun(tmp_path, "submit", str(_project(tmp_path, ["true"])), "-c", "local", check=True))
    registry = Registry(_registry(tmp_path))
    for i in range(50):
        run_dir = f"/nonexistent/pre-{i}"
        registry.add(
            builders.record(f"pre-{i}", cluster="local", run_dir=run_dir, scheduler="local", submitted_at=time.time())
        )
    registry.close()
    kept = {first, *(f"pre-{i}" for i in range(50))}
    for trial in range(trials(3, 30)):
        kept |= set(_kill_writer_midway(tmp_path, trial, rng))
        registry = Registry(_registry(tmp_path))  # opens (rolling back a half-done transaction)
        try:
            assert registry._db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            states = dict(registry._db.execute("SELECT job_id, last_state FROM jobs").fetchall())
        finally:
            registry.close()
        assert kept <= set(states), f"trial {trial}: lost {sorted(kept - set(states))[:5]}"
        assert all(states[k] in ("SUBMITTED", "RUNNING") for k in states if k.startswith("w")), states
    after, _ = submitted(meshrun(tmp_path, "submit", str(_project(tmp_path, ["true"])), "-c", "local", check=True))
    rows = _wait_all(tmp_path, [first, after])
    assert [r["state"] for r in rows] == ["COMPLETED", "COMPLETED"], rows


# ------------------------------------------------------------------ status of 1,000 jobs

# Runs the real CLI with every Transport call of this process counted (written to $COUNT_FILE at exit).
COUNTING = """
import json, os, sys
from meshrun.submit import api
from meshrun.submit.cli import main as cli
calls, real = [], api.connect
METHODS = {"run", "put", "stream", "forward", "write_text", "read_bytes", "makedirs", "exists", "size", "home"}
class Counting:
    def __init__(self, inner): self.inner = inner
    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in METHODS:
            return attr
        def counted(*args, **kwargs):
            calls.append(name)
            return attr(*args, **kwargs)
        return counted
api.connect = lambda *args, **kwargs: Counting(real(*args, **kwargs))
code = cli.main(sys.argv[1:])
open(os.environ["COUNT_FILE"], "w").write(json.dumps(calls))
sys.exit(code)
"""
COLUMNS = [f.name for f in dataclasses.fields(JobRecord)]
SHIM = '#!/bin/sh\necho "$0" >> {log}\nexec {real} "$@"\n'


def fill_registry(home: Path, runs: Path, n: int, cluster: str = "testbed", profile: str | None = None) -> list[str]:
    """n Slurm records straight into the registry (one transaction), each with a run dir whose metrics.jsonl
    says step = its index; ids far above the testbed's own (Slurm does not know them)."""
    ids = [str(7_000_000 + i) for i in range(n)]
    records: list[tuple[Any, ...]] = []
    for i, job_id in enumerate(ids):
        run_dir = runs / f"job-{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(json.dumps({"step": i, "loss": 1.0}) + "\n")
        record = JobRecord(job_id, cluster, "many", str(run_dir), "slurm", 1e9 + i, None, "0" * 64, "RUNNING", profile)
        records.append(tuple(getattr(record, column) for column in COLUMNS))  # every column the registry has
    Registry(_registry(home)).close()  # the file and its table, as meshrun makes them
    db = sqlite3.connect(_registry(home))
    with db:
        db.executemany(f"INSERT INTO jobs ({','.join(COLUMNS)}) VALUES ({','.join('?' * len(COLUMNS))})", records)
    db.close()
    return ids


def test_status_of_1000_jobs_is_one_remote_command(testbed: dict[str, object], tmp_path: Path) -> None:
    ids = fill_registry(tmp_path, tmp_path / "runs", 1000)
    shims, log = tmp_path / "shims", tmp_path / "scheduler-calls.log"
    shims.mkdir()
    for name in ("squeue", "sacct", "sbatch", "scontrol"):
        real = shutil.which(name)
        assert real, name
        (shims / name).write_text(SHIM.format(log=log, real=real))
        (shims / name).chmod(0o755)
    env = {"PATH": f"{shims}:{os.environ['PATH']}", "COUNT_FILE": str(tmp_path / "calls.json")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", COUNTING, "status", "-n", "1000", "--json"],
        cwd=REPO,
        env={**env_for(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "calls.json").read_text()) == ["run"]  # ONE remote command for 1,000 jobs
    assert sorted(Path(line).name for line in log.read_text().splitlines()) == ["sacct", "squeue"]
    rows = json.loads(done.stdout)
    assert [r["job_id"] for r in rows] == ids[::-1]  # newest first, each once
    assert all(r["progress"]["step"] == int(r["job_id"]) - 7_000_000 for r in rows)  # every tail came back
    print(f"status of 1,000 jobs: {seconds:.1f} s")


# ------------------------------------------------------------------ logs -f of a 1 GB log

GB = 1 << 30
BURST = 128 << 20
LINE = b"an old line of a big log, the same text again and again, read by nobody ..........\n"
BLOCK = LINE * ((1 << 20) // len(LINE))


def _proc(pid: int) -> tuple[int, int]:
    """(bytes the process has read, its peak RSS in bytes) from /proc."""
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    hwm = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return int(io["rchar"]), int(hwm.split()[1]) * 1024


def _append(log: Path, size: int, last: bytes) -> None:
    with open(log, "ab") as out:
        for _ in range(size // len(BLOCK)):
            out.write(BLOCK)
        out.write(last)


class Reader:
    """Copies a process's stdout into a file, and can stop reading it (a terminal that cannot keep up)."""

    def __init__(self, pipe: IO[bytes], path: Path) -> None:
        self.pipe, self.path, self.reading = pipe, path, threading.Event()
        self.out = open(path, "wb")  # noqa: SIM115 - the thread closes it
        self.reading.set()
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        with self.out as out:
            while self.reading.wait() and (chunk := os.read(self.pipe.fileno(), 1 << 20)):
                out.write(chunk)
                out.flush()

    def wait_for(self, needle: bytes, proc: subprocess.Popen[bytes], timeout: float) -> float:
        started, deadline = time.monotonic(), time.monotonic() + timeout
        while needle not in self.path.read_bytes()[-65536:]:
            assert proc.poll() is None and time.monotonic() < deadline, f"{needle!r} not followed in {timeout} s"
            time.sleep(0.05)
        return time.monotonic() - started


def test_follow_a_1gb_log_reads_its_tail_in_constant_memory(tmp_path: Path) -> None:
    spec = _project(tmp_path, ["sleep", "300"])
    job_id, run_dir = submitted(meshrun(tmp_path, "submit", str(spec), "-c", "local", check=True))
    log, followed = run_dir / "logs" / "rank-0.log", tmp_path / "followed.out"
    deadline = time.monotonic() + 60
    while not log.exists():
        assert time.monotonic() < deadline, "the rank never started"
        time.sleep(0.1)
    try:
        _append(log, GB, b"THE LAST OLD LINE\n")
        argv = [sys.executable, "-m", "meshrun.submit.cli.main", "logs", job_id, "-f"]
        with open(tmp_path / "followed.err", "wb") as err:
            follower = subprocess.Popen(argv, cwd=REPO, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=err)
        assert follower.stdout is not None
        reader = Reader(follower.stdout, followed)
        try:
            first_s = reader.wait_for(b"THE LAST OLD LINE\n", follower, 30)
            _append(log, 100, b"a new line, appended while followed\n")
            reader.wait_for(b"a new line, appended while followed\n", follower, 30)
            read, peak = _proc(follower.pid)
            # A burst while the output is not read: what is read ahead must stay bounded, not the burst.
            reader.reading.clear()
            _append(log, BURST, b"the burst's end\n")
            time.sleep(1.0)  # time to read far ahead (page cache: GB/s), were it unbounded
            burst_read, burst_peak = _proc(follower.pid)
            reader.reading.set()
            reader.wait_for(b"the burst's end\n", follower, 60)
        finally:
            follower.terminate()
            follower.wait(timeout=30)
            reader.reading.set()
        text = followed.read_bytes()
        assert read < 64 << 20 and peak < 128 << 20, (read, peak)  # far below the 1 GB it follows
        assert burst_read - read < 32 << 20 and burst_peak < peak + (32 << 20), (read, burst_read, peak, burst_peak)
        assert text.startswith(LINE) and text.index(b"THE LAST OLD LINE\n") <= 1 << 20  # began near the end
        assert len(text) < (1 << 20) + BURST + 4096
        assert "following from its last" in (tmp_path / "followed.err").read_text()
        print(
            f"logs -f of 1 GB: tail shown in {first_s:.2f} s, read {read >> 20} MB, peak RSS {peak >> 20} MB; "
            f"{burst_peak >> 20} MB with a {BURST >> 20} MB burst unread"
        )
    finally:
        log.unlink(missing_ok=True)
        followed.unlink(missing_ok=True)
        meshrun(tmp_path, "cancel", job_id, check=True)
