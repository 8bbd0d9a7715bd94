"""ELAPSED while a job's cluster cannot be reached: the value the last status that reached it saw, with its age
(it showed '-'). The registry keeps what status read; no cluster needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshrun.submit.core import status as core
from meshrun.submit.core.registry import JobRecord, Registry
from meshrun.submit.core.state import JobState
from meshrun.submit.errors import ClusterError
from meshrun.submit.views.tables import progress_line, status_table


class _Cluster:
    """One cluster, up until `down` is set."""

    def __init__(self) -> None:
        self.down = False

    def transport_for(self, record: JobRecord) -> Any:
        if self.down:
            raise ClusterError("ssh: connect to host login.example port 22: No route to host")
        return object()


class _Reader:
    def __init__(self, elapsed: dict[str, int]) -> None:
        self.elapsed = elapsed

    def statuses(self, records: Any, transport: Any, detail: bool = False, live: bool = False) -> list[core.Status]:
        return [
            core.Status(
                r.job_id, r.cluster, r.name, JobState.RUNNING, r.run_dir, 0.0, False, False, self.elapsed[r.job_id]
            )
            for r in records
        ]


def test_an_unreachable_jobs_elapsed_is_the_last_seen_with_its_age(tmp_path: Path, monkeypatch) -> None:
    registry = Registry(tmp_path / "r.sqlite")
    registry.add(JobRecord("8", "c", "n", "/r", "slurm", 0.0, None, "h"))
    registry.add(JobRecord("9", "d", "n", "/r", "slurm", 0.0, None, "h"))
    cluster, reader = _Cluster(), _Reader({"8": 200, "9": 7})
    monkeypatch.setattr(core.time, "time", lambda: 1000.0)
    seen = core.statuses([registry.find("8")], cluster, lambda _name: reader, registry)
    assert seen[0].elapsed_s == 200 and seen[0].elapsed_as_of is None

    cluster.down = True  # five minutes later: the cluster is down; another one still answers
    records = [registry.find("8"), registry.find("9")]
    found = core.statuses(records, _Clusters(cluster), lambda _name: reader, registry, warn=lambda _m: None)
    assert found[0].state == JobState.UNREACHABLE
    assert (found[0].elapsed_s, found[0].elapsed_as_of) == (200, 1000.0)
    monkeypatch.setattr("meshrun.submit.views.tables.time.time", lambda: 1300.0)
    row = next(line for line in status_table(found).splitlines() if line.startswith("8 "))
    assert "0:03:20 (as of 5m ago)" in row, row
    assert "elapsed 0:03:20 (as of 5m ago)" in progress_line(found[0], None)
    other = next(line for line in status_table(found).splitlines() if line.startswith("9 "))
    assert "0:00:07" in other and "as of" not in other  # a reachable job's ELAPSED is today's
    # What an unreachable refresh shows is not recorded as seen: the age stays that of the last real answer.
    assert registry.find("8").last_seen_at == 1000.0 and registry.find("8").last_elapsed_s == 200


def test_a_job_never_seen_shows_no_elapsed_while_unreachable(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "r.sqlite")
    registry.add(JobRecord("8", "c", "n", "/r", "slurm", 0.0, None, "h"))
    registry.add(JobRecord("9", "d", "n", "/r", "slurm", 0.0, None, "h"))
    cluster = _Cluster()
    cluster.down = True
    records = [registry.find("8"), registry.find("9")]
    found = core.statuses(records, _Clusters(cluster), lambda _name: _Reader({"9": 7}), registry, warn=lambda _m: None)
    assert found[0].elapsed_s is None and found[0].elapsed_as_of is None
    assert "UNREACHABLE" in status_table(found)


class _Clusters:
    """Cluster c as `down` says; cluster d always answers."""

    def __init__(self, c: _Cluster) -> None:
        self.c = c

    def transport_for(self, record: JobRecord) -> Any:
        return self.c.transport_for(record) if record.cluster == "c" else object()
