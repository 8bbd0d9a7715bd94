"""The local record of submitted jobs (sqlite under $XDG_STATE_HOME/meshrun).

`status`, `logs` and `cancel` find a job here by its id, then ask its cluster.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from meshrun.launcher.contract.private import make_private_dir
from meshrun.submit.core.state import JobState
from meshrun.submit.errors import InputError, JobNotFound
from meshrun.submit.folders import state_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT NOT NULL,
    cluster TEXT NOT NULL,
    name TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    scheduler TEXT NOT NULL,
    submitted_at REAL NOT NULL,
    git_sha TEXT,
    spec_hash TEXT NOT NULL,
    last_state TEXT NOT NULL DEFAULT 'SUBMITTED',
    profile TEXT,
    last_progress TEXT,
    chosen TEXT,
    last_elapsed_s INTEGER,
    last_seen_at REAL,
    last_reason TEXT,
    last_restarts INTEGER,
    last_restarts_in_job INTEGER,
    PRIMARY KEY (cluster, job_id)
)
"""
_COLUMNS = (
    "job_id",
    "cluster",
    "name",
    "run_dir",
    "scheduler",
    "submitted_at",
    "git_sha",
    "spec_hash",
    "last_state",
    "profile",
    "last_progress",
    "chosen",
    "last_elapsed_s",
    "last_seen_at",
    "last_reason",
    "last_restarts",
    "last_restarts_in_job",
)


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    """The scheduler's job id (Slurm's number, or local-… on the local cluster)."""
    cluster: str
    """Cluster profile name."""
    name: str
    """Job name."""
    run_dir: str
    """The run dir on the cluster."""
    scheduler: str
    """slurm or local."""
    submitted_at: float
    """Unix time of submission."""
    git_sha: Optional[str]
    """The submitting checkout's commit, if it was a git checkout."""
    spec_hash: str
    """Hash of the validated spec."""
    last_state: str = JobState.SUBMITTED.value
    """The last state meshrun saw: a JobState's word (submit/core/state.py), kept as the registry file holds it
    (a row an older meshrun wrote may hold a word the type no longer has)."""
    profile: Optional[str] = None
    """The profile file's absolute path when it was given as a file (-c my.yaml); None for a named one.
    status/logs/cancel/tb reload the profile from here, so a profile outside the profile folders works too."""
    last_progress: Optional[str] = None
    """The progress (JSON) status saw when the job reached its final state: what its row keeps showing once
    a resume in the same run dir has pushed its lines out of the metrics tail status reads."""
    chosen: Optional[str] = None
    """Why this cluster and partition (`submit -c any` or `-c a,b`: the soonest start of those asked), for status."""
    last_elapsed_s: Optional[int] = None
    """The job's ELAPSED (its whole life) at the last status that reached its cluster: what status shows, with
    its age, while the cluster cannot be reached."""
    last_seen_at: Optional[float] = None
    """Unix time of that status."""
    last_reason: Optional[str] = None
    """The reason status saw with the final state: a resume in the same run dir starts by removing the run dir's
    rank error, which the ended job's reason was read from."""
    last_restarts: Optional[int] = None
    """The requeues status saw with the final state (RESTARTS' first figure): shown while the cluster cannot be
    reached, as the rest of an ended job's row."""
    last_restarts_in_job: Optional[int] = None
    """The restarts inside the allocation status saw with the final state (RESTARTS' second figure)."""

    def resubmitted(self, job_id: str, submitted_at: float) -> JobRecord:
        """This job's record for a new job in the same run dir (`meshrun resume`): nothing status saw of this
        one (its state, progress, reason, restarts, elapsed time) carries over to the new one."""
        return dataclasses.replace(
            self,
            job_id=job_id,
            submitted_at=submitted_at,
            last_state=JobState.SUBMITTED.value,
            last_progress=None,
            last_elapsed_s=None,
            last_seen_at=None,
            last_reason=None,
            last_restarts=None,
            last_restarts_in_job=None,
            chosen=None,
        )


def default_path() -> Path:
    return state_dir() / "registry.sqlite"


def _private(path: Path) -> None:
    """The registry lists every job's run dir and host: on a shared login node it is the user's alone
    (folder 0700, file 0600), whatever the umask."""
    make_private_dir(path.parent)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)


class Registry:
    def __init__(self, path: Optional[Path] = None) -> None:
        self.path = Path(path) if path else default_path()
        _private(self.path)
        import sqlite3  # here: `render` and `plan` import this module and never open the registry

        self._db = sqlite3.connect(self.path, timeout=10)
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        if "profile" not in columns:  # a registry written before profiles were remembered
            self._db.execute("ALTER TABLE jobs ADD COLUMN profile TEXT")
        if "last_progress" not in columns:  # ... or before a final job's progress was
            self._db.execute("ALTER TABLE jobs ADD COLUMN last_progress TEXT")
        if "chosen" not in columns:  # ... or before a cluster could be chosen for the job
            self._db.execute("ALTER TABLE jobs ADD COLUMN chosen TEXT")
        if "last_elapsed_s" not in columns:  # ... or before the last elapsed time seen was
            self._db.execute("ALTER TABLE jobs ADD COLUMN last_elapsed_s INTEGER")
            self._db.execute("ALTER TABLE jobs ADD COLUMN last_seen_at REAL")
        if "last_reason" not in columns:  # ... or before a final job's reason was kept
            self._db.execute("ALTER TABLE jobs ADD COLUMN last_reason TEXT")
        if "last_restarts" not in columns:  # ... or before its restarts were
            self._db.execute("ALTER TABLE jobs ADD COLUMN last_restarts INTEGER")
            self._db.execute("ALTER TABLE jobs ADD COLUMN last_restarts_in_job INTEGER")
        self._db.commit()

    def add(self, record: JobRecord) -> None:
        with self._db:
            self._db.execute(
                f"INSERT OR REPLACE INTO jobs ({','.join(_COLUMNS)}) VALUES ({','.join('?' * len(_COLUMNS))})",
                tuple(getattr(record, c) for c in _COLUMNS),
            )

    def set_chosen(self, record: JobRecord, why: str) -> None:
        """Record why the job's cluster was chosen (`submit -c any`)."""
        with self._db:
            self._db.execute(
                "UPDATE jobs SET chosen = ? WHERE cluster = ? AND job_id = ?", (why, record.cluster, record.job_id)
            )

    def set_state(
        self,
        record: JobRecord,
        state: str,
        progress: Optional[str] = None,
        reason: Optional[str] = None,
        restarts: Optional[tuple[int, int]] = None,
    ) -> None:
        """The state status saw; `progress` (JSON), `reason` and `restarts` (requeues, restarts in the allocation)
        kept with a final one (None keeps what was there)."""
        requeues, in_job = restarts if restarts is not None else (None, None)
        with self._db:
            self._db.execute(
                "UPDATE jobs SET last_state=?, last_progress=COALESCE(?, last_progress), "
                "last_reason=COALESCE(?, last_reason), last_restarts=COALESCE(?, last_restarts), "
                "last_restarts_in_job=COALESCE(?, last_restarts_in_job) WHERE cluster=? AND job_id=?",
                (state, progress, reason, requeues, in_job, record.cluster, record.job_id),
            )

    def set_seen(self, seen: Sequence[tuple[JobRecord, int]], at: float) -> None:
        """The ELAPSED each job had when status reached its cluster at `at` (one transaction for them all)."""
        if not seen:
            return
        with self._db:
            self._db.executemany(
                "UPDATE jobs SET last_elapsed_s=?, last_seen_at=? WHERE cluster=? AND job_id=?",
                [(elapsed, at, record.cluster, record.job_id) for record, elapsed in seen],
            )

    def _rows(self, where: str = "", args: tuple[Any, ...] = ()) -> Iterator[JobRecord]:
        query = f"SELECT {','.join(_COLUMNS)} FROM jobs {where} ORDER BY submitted_at DESC, job_id"
        for row in self._db.execute(query, args):
            yield JobRecord(*row)

    def find(self, job_id: str, cluster: Optional[str] = None) -> JobRecord:
        """The one job with this id (on this cluster, if given)."""
        where, args = ("WHERE job_id=? AND cluster=?", (job_id, cluster)) if cluster else ("WHERE job_id=?", (job_id,))
        found = list(self._rows(where, args))
        if not found:
            raise JobNotFound(
                "JOB", job_id, "no job with this id in the local registry; `meshrun status` lists the known ones"
            )
        if len(found) > 1:
            raise InputError(
                "JOB", job_id, f"this id exists on clusters {', '.join(r.cluster for r in found)}; add -c CLUSTER"
            )
        return found[0]

    def find_all(self, job_id: str, cluster: Optional[str] = None) -> list[JobRecord]:
        """The job with this id, or, for a job array's id, all its tasks (ID_0, ID_1, ...)."""
        try:
            return [self.find(job_id, cluster)]
        except JobNotFound:
            where = "WHERE job_id LIKE ? ESCAPE '!'" + (" AND cluster=?" if cluster else "")
            pattern = job_id.replace("!", "!!").replace("_", "!_").replace("%", "!%") + "!_%"
            tasks = list(self._rows(where, (pattern, cluster) if cluster else (pattern,)))
            if not tasks:
                raise
            if len({t.cluster for t in tasks}) > 1:
                raise InputError("JOB", job_id, "this array id exists on several clusters; add -c CLUSTER") from None
            return sorted(tasks, key=lambda t: int(t.job_id.rsplit("_", 1)[1]))

    def recent(self, limit: int = 20, cluster: Optional[str] = None) -> list[JobRecord]:
        where, args = ("WHERE cluster=?", (cluster,)) if cluster else ("", ())
        return list(self._rows(where, args))[:limit]

    def close(self) -> None:
        self._db.close()


def now() -> float:
    return time.time()
