"""The flags that name a port or a rank: `tb --port` out of range or in use, a port forward that cannot bind,
`logs --rank` past the job's ranks: bad input in one line, never a traceback."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.submit.core.registry import JobRecord
from meshrun.submit.errors import ClusterError, InputError
from meshrun.submit.transport.base import LocalTransport
from meshrun.submit.transport.portforward import PortForward
from meshrun.submit.views import logs
from meshrun.submit.views.tensorboard import check_local_port
from tests.helpers import builders


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        yield other.getsockname()[1]


# --- tb --port ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("port", [-1, 65536, 70000])
def test_port_out_of_range_is_bad_input(port: int) -> None:
    with pytest.raises(InputError) as caught:
        check_local_port(port)
    assert caught.value.key == "--port" and caught.value.value == port
    assert "1024-65535, or 0" in str(caught.value)


def test_port_in_use_is_bad_input(busy_port: int) -> None:
    with pytest.raises(InputError) as caught:
        check_local_port(busy_port)
    assert caught.value.key == "--port" and "in use" in str(caught.value).lower()


def test_free_port_and_zero_pass() -> None:
    check_local_port(0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    check_local_port(free)


@pytest.mark.parametrize("bad", ["busy", 70000, -5])
def test_forward_that_cannot_bind_fails_in_one_line(bad: object, busy_port: int) -> None:
    port = busy_port if bad == "busy" else bad
    with pytest.raises(ClusterError) as caught:
        PortForward(lambda peer: None, port)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "--port" in message


# --- logs --rank past the job's ranks ---------------------------------------------------------------------------


def test_rank_past_the_world_size_names_the_size() -> None:
    with pytest.raises(InputError) as caught:
        logs.parse_ranks("99", 2)
    assert (caught.value.key, caught.value.value, caught.value.fix) == ("--rank", 99, "the job has 2 ranks (0-1)")
    with pytest.raises(InputError, match="the job has 4 ranks"):
        logs.parse_ranks("0,4", 4)


def test_select_ranks_reads_the_world_size_even_for_one_rank(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))
    Path(run.spec).write_text(json.dumps({"job": {"resources": {"nodes": 1, "tasks_per_node": 2}}}))
    record = builders.record(cluster="local", run_dir=tmp_path, scheduler="local", submitted_at=time.time())
    assert logs.select_ranks(LocalTransport(), record, "1") == [1]
    with pytest.raises(InputError, match=r"the job has 2 ranks \(0-1\)"):
        logs.select_ranks(LocalTransport(), record, "99")


def test_select_ranks_without_a_spec_yet_accepts_any_rank(tmp_path: Path) -> None:
    record = builders.record(cluster="local", run_dir=tmp_path, scheduler="local", submitted_at=time.time())
    assert logs.select_ranks(LocalTransport(), record, "7") == [7]


def test_logs_f_survives_a_connection_dropped_while_it_asks_for_the_jobs_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A laptop journey (seed 207) killed the SSH connection just as `logs -f` read the job's size: it exited 1
    ("the connection was lost") instead of reconnecting as it does once following. Without -f it says so."""
    import io

    from meshrun.submit.core.registry import JobRecord
    from meshrun.submit.errors import ConnectionLost
    from meshrun.submit.transport.base import LocalTransport
    from meshrun.submit.views import logs

    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "spec.json").write_text('{"job": {"resources": {"nodes": 1, "tasks_per_node": 2}}}')
    record = JobRecord("7", "c", "n", str(run_dir), "slurm", 0.0, None, "h")

    class Dropping(LocalTransport):
        def read_bytes(self, path: str, offset: int = 0, limit: int = 1 << 20) -> bytes:
            raise ConnectionLost("ssh: the connection to c was lost")

    class Clusters:
        def __init__(self) -> None:
            self.current: LocalTransport = Dropping()
            self.reconnects = 0

        def transport_for(self, record: JobRecord) -> LocalTransport:
            return self.current

        def reconnect(self, record: JobRecord) -> LocalTransport:
            self.reconnects += 1
            self.current = LocalTransport()
            return self.current

    clusters, err = Clusters(), io.StringIO()
    sources = logs.sources_for(clusters, record, "all", False, err, follow=True)  # type: ignore[arg-type]
    assert [s.label for s in sources] == [b"[rank 0] ", b"[rank 1] "] and clusters.reconnects == 1
    assert "reconnecting" in err.getvalue() and "reconnected" in err.getvalue()
    with pytest.raises(ConnectionLost):
        logs.sources_for(Clusters(), record, "all", False, io.StringIO(), follow=False)  # type: ignore[arg-type]
