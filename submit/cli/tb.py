"""`meshrun tb JOB [JOB...]` (TensorBoard of jobs, forwarded here) and `meshrun tb --stop` (servers left running).

The server runs on the login node and lives as long as this command: Ctrl-C, SIGTERM and SIGHUP (the
terminal closed) all close the forward and stop the server this command started; one that arrives while the
server starts takes effect once the helper answered (so the server it started is known, and stopped). A `meshrun tb` that
could not (killed with -9, the machine gone) leaves it running; `--stop` ends it, on the login node,
only after checking the pid is still that server (tbserve.py `stop`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any, NoReturn, Sequence, TextIO

from meshrun.submit.errors import InputError

TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""A kill, or the terminal closing: torn down like Ctrl-C."""
SERVER_CHECK_TICKS = 5
"""Every this many seconds the server is asked whether it still answers: a `meshrun tb --stop` from another
terminal (or a kill) must end this command, not leave it forwarding to nothing."""


def add_parser(verbs: Any) -> None:
    p = verbs.add_parser(
        "tb",
        help="TensorBoard of jobs (one cluster's), on the login node, forwarded here; Ctrl-C or closing the "
        "terminal stops it; --stop stops one left running",
    )
    p.add_argument("jobs", nargs="*", metavar="JOB", help="job ids; a job array's id serves all its tasks")
    p.add_argument("--port", type=int, default=0, help="local port (default: any free one)")
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")
    p.add_argument(
        "--stop",
        action="store_true",
        help="stop your TensorBoard servers showing these jobs (with -c CLUSTER and no JOB: all of yours there)",
    )


def _raise_interrupt(signum: int, frame: Any) -> NoReturn:
    raise KeyboardInterrupt


def _say(text: str, to: TextIO) -> None:
    """Print if anyone still reads it: after SIGHUP the terminal is gone, and the teardown must go on."""
    try:
        print(text, file=to, flush=True)
    except OSError:
        pass


def cmd_tb(args: argparse.Namespace) -> int:
    if args.stop:
        return _cmd_stop(args)
    if not args.jobs:
        raise InputError("JOB", "", "give the ids of the jobs to show (or --stop to stop a TensorBoard left running)")
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.views import tensorboard

    tensorboard.check_local_port(args.port)  # before anything starts on the cluster
    records = _tb_records(Registry(), args.jobs, args.cluster)
    record = records[0]  # all on one cluster: its connection serves them all
    runs = [(tensorboard.label(r.job_id), r.run_dir) for r in records]
    clusters = api.Clusters()
    board, forward = None, None
    before = {sig: signal.signal(sig, _raise_interrupt) for sig in TEARDOWN_SIGNALS}
    try:
        transport = clusters.transport_for(record)
        board, stopped = _start_deferring_stops(tensorboard, transport, clusters.profile_for(record), runs)
        if stopped:
            return 0  # the finally below stops the server this command started
        forward = transport.forward(board.port, args.port)
        names = ", ".join(name for name, _ in runs)
        _say(
            f"TensorBoard for job{'s' if len(runs) > 1 else ''} {names}: {board.url(forward.local_port)}"
            + (" (already running)" if board.reused else ""),
            sys.stdout,
        )
        if tensorboard.is_local(transport) and api.reaches_other_machines(clusters.profile_for(record).scheduler):
            # On a login node a laptop needs the tunnel; the `local` cluster is this machine's own jobs.
            _say(
                f"from your laptop: {tensorboard.ssh_hint(board.port, args.port or None)} "
                f"then open {board.url(args.port or board.port)}",
                sys.stdout,
            )
        _say(
            "the URL carries this server's secret: other users cannot open the board; "
            + (
                f"Ctrl-C closes the tunnel (TensorBoard keeps running: `meshrun tb --stop {record.job_id}` stops it)"
                if board.reused
                else "Ctrl-C (or closing this terminal) stops it"
            ),
            sys.stdout,
        )
        ticks, misses = 0, 0
        while True:
            time.sleep(1.0)
            if not getattr(transport, "is_active", lambda: True)():
                forward.close()  # the connection dropped: a new one, same local port
                transport = clusters.reconnect(record)
                forward = transport.forward(board.port, forward.local_port)
                continue
            ticks += 1
            if ticks % SERVER_CHECK_TICKS == 0:
                misses = 0 if _answers(forward.local_port) else misses + 1
                if misses >= 2:  # twice in a row: not one slow answer
                    _say(
                        f"meshrun: TensorBoard (pid {board.pid} {_place(clusters.profile_for(record))}) has stopped "
                        f"(`meshrun tb --stop`, or it was killed); closing the tunnel",
                        sys.stderr,
                    )
                    board = None  # nothing left to stop
                    return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for sig in TEARDOWN_SIGNALS:  # the teardown runs to its end whatever arrives next
            signal.signal(sig, signal.SIG_IGN)
        if forward is not None:
            forward.close()
        if board is not None and not board.reused:
            _stop_board(clusters, record, board)
        clusters.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _start_deferring_stops(tensorboard: Any, transport: Any, profile: Any, runs: Any) -> tuple[Any, bool]:
    """The helper's start, with Ctrl-C, SIGTERM and SIGHUP held until it answers: one arriving after the helper
    claimed the server but before its answer was read would leave a server nobody stops (it stops itself only
    when unclaimed). Returns the server and whether a stop arrived meanwhile (the caller then stops it)."""
    from meshrun.submit.errors import ClusterError

    arrived: list[int] = []
    held = (signal.SIGINT, *TEARDOWN_SIGNALS)
    before = {sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in held}
    try:
        board = tensorboard.start(transport, profile, runs)
    except ClusterError:
        if arrived:  # the helper itself was interrupted (a terminal's Ctrl-C reaches it too): nothing claimed
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return board, bool(arrived)


def _answers(port: int, timeout_s: float = 10.0) -> bool:
    """Whether the server answers an HTTP request through 127.0.0.1:port (a refusal for want of the token is
    an answer); a forward whose server is gone closes the connection without a byte."""
    try:
        import socket  # here, not at the top: every other verb's start-up would pay for it

        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as conn:
            conn.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
            return bool(conn.recv(1))
    except OSError:
        return False


def _tb_records(registry: Any, jobs: Sequence[str], cluster: Any) -> list[Any]:
    """The runs of `meshrun tb JOB...`: each job, or each task of an array id, once; all on one cluster."""
    records: dict[str, Any] = {}
    for job in jobs:
        for found in registry.find_all(job, cluster):
            records.setdefault(found.job_id, found)
    where = sorted({r.cluster for r in records.values()})
    if len(where) > 1:
        raise InputError(
            "JOB",
            " ".join(jobs),
            f"these jobs run on {len(where)} clusters ({', '.join(where)}); one `meshrun tb` serves one "
            "cluster's runs: start one per cluster",
        )
    return list(records.values())


def _place(profile: Any) -> str:
    """Where the server runs, as the user knows it: a `local` cluster's is on this machine."""
    from meshrun.submit import api

    return "on the login node" if api.reaches_other_machines(profile.scheduler) else "on this machine"


def _stop_board(clusters: Any, record: Any, board: Any) -> None:
    from meshrun.submit.errors import MeshrunError
    from meshrun.submit.views import tensorboard

    profile = clusters.profile_for(record)
    place = _place(profile)
    try:
        try:
            stopped = tensorboard.stop(clusters.transport_for(record), profile, board)
        except MeshrunError:
            stopped = tensorboard.stop(clusters.reconnect(record), profile, board)  # the connection had dropped
        if stopped:
            _say(f"stopped TensorBoard (pid {board.pid} {place})", sys.stderr)
        else:
            _say(f"TensorBoard (pid {board.pid} {place}) had already stopped", sys.stderr)
    except MeshrunError as exc:
        _say(
            f"meshrun: could not stop TensorBoard (pid {board.pid} {place}): {exc}; "
            f"`meshrun tb --stop {record.job_id}` stops it",
            sys.stderr,
        )


def _cmd_stop(args: argparse.Namespace) -> int:
    """`meshrun tb --stop JOB...` (servers showing any of the jobs) or `--stop -c CLUSTER` (all of yours there)."""
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.views import tensorboard

    clusters = api.Clusters()
    try:
        if args.jobs:
            records = _tb_records(Registry(), args.jobs, args.cluster)
            key, where = clusters.key(records[0]), records[0].cluster
            select = [tensorboard.label(r.job_id) for r in records]
            nothing = f"no TensorBoard of yours serves {' '.join(select)} on {where}"
        elif args.cluster:
            key, where, select = args.cluster, args.cluster, ["--all"]
            nothing = f"no TensorBoard of yours runs on {where}"
        else:
            raise InputError(
                "--stop", "", "give the ids of the jobs whose TensorBoard to stop, or -c CLUSTER to stop all of yours"
            )
        stopped = tensorboard.stop_servers(clusters.transport(key), clusters.profile(key), *select)
        place = _place(clusters.profile(key))
    finally:
        clusters.close()
    for server in stopped:
        print(f"stopped TensorBoard (pid {server.pid} {place}) serving {', '.join(server.runs)}")
    if not stopped:
        print(nothing)
    return 0
