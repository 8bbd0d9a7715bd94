"""A submitted job's spec.json, read where the job runs (this machine or the cluster): what resume, export and
a restart's secrets learn the job from."""

from __future__ import annotations

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.launcher.contract.spec.job import RunSpec, SpecFileError, loads_run_spec
from meshrun.submit.core.registry import JobRecord
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.transport.base import Transport


def read_run_spec(record: JobRecord, transport: Transport) -> RunSpec:
    """The run dir's spec.json, validated (one line naming the file when it is gone, cut or edited)."""
    path = RunDir(record.run_dir).spec
    raw = transport.read_bytes(path, 0, 1 << 22)
    if not raw:
        if not transport.exists(record.run_dir):
            raise ClusterError(
                f"the run dir of job {record.job_id} is gone ({record.run_dir}) with its spec and checkpoints"
            )
        raise ClusterError(f"{path} is missing: the run dir of job {record.job_id} was emptied")
    try:
        return loads_run_spec(raw.decode("utf-8", errors="replace"), path)
    except SpecFileError as exc:
        raise InputError(exc.key, exc.value, exc.fix) from None
