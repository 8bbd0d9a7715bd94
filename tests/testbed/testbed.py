"""A real Slurm cluster and a key-only sshd on this one machine, for the integration tests.

`up()` starts munged, MariaDB, slurmdbd, slurmctld, three slurmd (emulated nodes n1, n2 and n3, two fake
GPUs each: the default partition holds n1 and n2, `wide` all three, so a 2-node job can have a spare) and an
OpenSSH sshd on 127.0.0.1; `down()` stops each of them by its own PID file.
Everything (configs, keys, state, logs) lives under TESTBED_DIR. Needs root and the Debian packages
that tests/testbed/install.sh installs.

    python -m tests.testbed.testbed up|down|status|env
    python -m tests.testbed.testbed profile [NAME]   # ~/.config/meshrun/clusters/NAME.yaml, over its sshd

Environment: MESHRUN_TESTBED_SLOT (default 0): testbeds of other slots run beside it, each with its own
folder (/tmp/meshrun-testbed, then /tmp/meshrun-testbed-N), ports (the defaults + 100 N) and job ids (from
N x 100000 + 1). Under pytest-xdist each worker has its own: worker gwN's slot is N, or MESHRUN_TESTBED_SLOT + N
when that is set (processes the tests start inherit PYTEST_XDIST_WORKER, so they find the same one). MESHRUN_TESTBED_DIR
and MESHRUN_TESTBED_{SLURMCTLD,SLURMDBD,SLURMD_N1,SLURMD_N2,SLURMD_N3,MARIADB,SSHD}_PORT override one part.
The shipped profile `testbed` (cluster_configs/testbed.yaml) names slot 0's folders; `profile_folder()` holds
the slot's own copy, for MESHRUN_CLUSTERS.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import pwd
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

SLOT_ENV = "MESHRUN_TESTBED_SLOT"
SLOT = int(os.environ.get(SLOT_ENV) or 0) + int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
"""Which of the testbeds that can run side by side on this machine this is (0: the one people start by hand)."""
SHIPPED_DIR = "/tmp/meshrun-testbed"
"""Slot 0's folder: the one cluster_configs/testbed.yaml names."""
TESTBED_DIR = Path(
    os.environ.get("MESHRUN_TESTBED_DIR") or (f"{SHIPPED_DIR}-{SLOT}" if SLOT else SHIPPED_DIR)
).absolute()
FIRST_JOB_ID = SLOT * 100_000 + 1
"""Job ids of different slots never meet (a job id names a job's processes and files on this one machine)."""

CLUSTER = "testbed"
NODES = ("n1", "n2", "n3")
PARTITION_NODES = NODES[:2]
"""The default (and the high) partition's nodes: the two every test but the spares' uses."""
WIDE_PARTITION = "wide"
"""All three nodes: a 2-node job with a spare (tests/integration/test_spare_nodes.py)."""
GPUS_PER_NODE = 2
CPUS_PER_NODE = 4
PARTITION = "debug"
HIGH_PARTITION = "high"
"""A partition over the same nodes whose jobs preempt (requeue) the default partition's."""
GRACE_TIME_S = 15
"""Seconds a preempted job gets between Slurm's SIGTERM and its SIGKILL."""


def _port(name: str, default: int) -> int:
    return int(os.environ.get(f"MESHRUN_TESTBED_{name}_PORT") or default + 100 * SLOT)


PORTS: dict[str, int] = {
    "slurmctld": _port("SLURMCTLD", 16817),
    "slurmdbd": _port("SLURMDBD", 16819),
    "slurmd-n1": _port("SLURMD_N1", 16821),
    "slurmd-n2": _port("SLURMD_N2", 16822),
    "slurmd-n3": _port("SLURMD_N3", 16823),
    "mariadb": _port("MARIADB", 13306),
    "sshd": _port("SSHD", 2222),
}

# Kept in step with install.sh's BINARIES.
REQUIRED_BINARIES = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sinfo",
    "squeue",
    "sbatch",
    "srun",
    "scancel",
    "sacct",
    "sacctmgr",
    "scontrol",
    "munged",
    "mungekey",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "sshd",
    "ssh-keygen",
    "mknod",
    "tmux",  # not the testbed's: `meshrun top` is tested in a real terminal (tmux capture-pane)
)

ETC = TESTBED_DIR / "etc"
RUN = TESTBED_DIR / "run"
LOG = TESTBED_DIR / "log"
MUNGE = TESTBED_DIR / "munge"
DB = TESTBED_DIR / "db"
STATE = TESTBED_DIR / "state"
SPOOL = TESTBED_DIR / "spool"
DEV = TESTBED_DIR / "dev"
SSH = TESTBED_DIR / "ssh"

SLURM_CONF = ETC / "slurm.conf"
MUNGE_SOCKET = MUNGE / "munge.socket.2"
DB_SOCKET = DB / "mysqld.sock"
DB_DATA = DB / "data"
SSH_HOST_KEY = SSH / "ssh_host_ed25519_key"
SSH_CLIENT_KEY = SSH / "id_ed25519"
SSH_KNOWN_HOSTS = SSH / "known_hosts"
SSH_AUTHORIZED_KEYS = SSH / "authorized_keys"

# The slurmdbd database user's password. The database listens on 127.0.0.1 only and lives as long
# as the testbed; slurmdbd.conf, which holds it, is mode 600 because slurmdbd insists.
DB_USER = "slurm"
DB_PASSWORD = "meshrun-testbed"

HOSTS_FILE = Path("/etc/hosts")
# The comment names the testbed, so down() removes exactly its own line.
HOSTS_LINE = f"127.0.0.1 {' '.join(NODES)}  # meshrun-testbed {TESTBED_DIR}"

# sbin is often missing from a non-login PATH; the daemons live there.
_SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_POLL_S = 0.05


class TestbedError(RuntimeError):
    """The testbed could not be started or checked; the message says why and what to look at."""


# --------------------------------------------------------------------------- public API


def client_env() -> dict[str, str]:
    """Variables a Slurm client command (sbatch, sacct, submitit...) needs to reach the testbed, and meshrun
    its profile `testbed` (other slots than 0: the slot's own copy, through MESHRUN_CLUSTERS)."""
    env = {"SLURM_CONF": str(SLURM_CONF)}
    if profile_file() != SHIPPED_PROFILE:
        env["MESHRUN_CLUSTERS"] = str(profile_file().parent)
    return env


SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "cluster_configs" / f"{CLUSTER}.yaml"


def profile_file() -> Path:
    """The profile `testbed` of this testbed: the shipped file when it names this folder (slot 0), else a copy
    in TESTBED_DIR/clusters naming this testbed's folders (written the first time it is asked for)."""
    if TESTBED_DIR == Path(SHIPPED_DIR):
        return SHIPPED_PROFILE
    own = TESTBED_DIR / "clusters" / SHIPPED_PROFILE.name
    text = SHIPPED_PROFILE.read_text().replace(f"{SHIPPED_DIR}/", f"{TESTBED_DIR}/")
    if not own.is_file() or own.read_text() != text:
        own.parent.mkdir(parents=True, exist_ok=True)
        own.write_text(text)
    return own


def ssh_info() -> dict[str, object]:
    """How to reach the testbed's sshd: host, port, user, identity_file, known_hosts."""
    return {
        "host": "127.0.0.1",
        "port": PORTS["sshd"],
        "user": pwd.getpwuid(os.getuid()).pw_name,
        "identity_file": str(SSH_CLIENT_KEY),
        "known_hosts": str(SSH_KNOWN_HOSTS),
    }


def info() -> dict[str, object]:
    """Everything a test needs to know about the testbed (what `up()` returns)."""
    return {
        "dir": str(TESTBED_DIR),
        "slurm_conf": str(SLURM_CONF),
        "cluster": CLUSTER,
        "partition": PARTITION,
        "nodes": list(NODES),
        "gpus_per_node": GPUS_PER_NODE,
        "cpus_per_node": CPUS_PER_NODE,
        "env": client_env(),
        "ssh": ssh_info(),
    }


def missing_binaries() -> list[str]:
    return [b for b in REQUIRED_BINARIES if _which(b) is None]


def up() -> dict[str, object]:
    """Start whatever part of the testbed is not running, wait until it all answers, return info().

    Idempotent: when everything already runs and answers, it only checks and returns.
    """
    _preflight()
    _make_dirs()
    with _locked():
        daemons = _daemons()
        # A testbed left running (MESHRUN_TESTBED_KEEP=1) by an older slurm.conf (say, before the preemption
        # partitions) takes the slow path: its configs are rewritten and its Slurm daemons restarted.
        current = SLURM_CONF.exists() and SLURM_CONF.read_text() == _slurm_conf()
        if current and all(_alive(d) for d in daemons) and _healthy(daemons):
            return info()
        _write_static_files()
        changed = _write_configs()
        _add_hosts_line()
        started: set[str] = set()
        for d in daemons:
            # A daemon running with an outdated config (e.g. a port was changed) gets restarted.
            if changed & set(d.configs):
                _stop(d)
            if d.name == "mariadb":
                _init_database()
            if _ensure_retrying(d):
                started.add(d.name)
            if d.name == "mariadb":
                _grant_slurm_user()
        _wait_cluster_ready()
        if "slurmctld" in started:
            # Jobs recovered from the saved state belong to a testbed that died without down()
            # (down() cancels everything); they would be requeued and hold the nodes.
            _cancel_all_jobs()
    return info()


def down(purge: bool = False) -> None:
    """Stop every testbed daemon by its PID file (and any job left running); idempotent.

    With purge, also delete TESTBED_DIR (keys, database, Slurm state), so the next up() starts
    from nothing; without it the next up() reuses them and is faster.
    """
    if not TESTBED_DIR.exists():
        _remove_hosts_line()
        return
    with _locked():
        daemons = _daemons()
        by_name = {d.name: d for d in daemons}
        if _alive(by_name["slurmctld"]):
            _cancel_all_jobs()
        for d in reversed(daemons):
            _stop(d)
        _kill_stray_steps()
        _remove_hosts_line()
    if purge:
        shutil.rmtree(TESTBED_DIR)


def status() -> dict[str, int | None]:
    """PID of each testbed daemon, or None where it is not running."""
    if not TESTBED_DIR.exists():
        return {d.name: None for d in _daemons()}
    return {d.name: (_pidfile_pid(d.pidfile) if _alive(d) else None) for d in _daemons()}


# --------------------------------------------------------------------------- daemons


@dataclass(frozen=True)
class Daemon:
    name: str
    argv: tuple[str, ...]
    pidfile: Path  # written by the daemon itself; the only handle down() uses
    ready: Callable[[], bool]  # cheap "does it answer" probe
    logs: tuple[Path, ...]  # their tails go into the error when it fails to start
    port: int | None = None
    configs: tuple[Path, ...] = ()  # restart the daemon when one of these changes
    timeout_s: float = 30.0


def _daemons() -> list[Daemon]:
    """The daemons in start order. All run in the foreground so their PID is the one we spawned."""
    slurm_configs = (SLURM_CONF, ETC / "gres.conf")
    daemons = [
        Daemon(
            name="munged",
            argv=(
                _bin("munged"),
                "-F",
                f"--socket={MUNGE_SOCKET}",
                f"--key-file={MUNGE / 'munge.key'}",
                f"--pid-file={RUN / 'munged.pid'}",
                f"--log-file={LOG / 'munged.log'}",
                f"--seed-file={MUNGE / 'munged.seed'}",
            ),
            pidfile=RUN / "munged.pid",
            ready=lambda: _unix_socket_answers(MUNGE_SOCKET),
            logs=(LOG / "munged.log", LOG / "munged.out"),
        ),
        Daemon(
            name="mariadb",
            argv=(
                _bin("mariadbd"),
                "--no-defaults",
                "--user=root",
                f"--datadir={DB_DATA}",
                f"--socket={DB_SOCKET}",
                f"--pid-file={RUN / 'mariadb.pid'}",
                f"--log-error={LOG / 'mariadb.log'}",
                "--bind-address=127.0.0.1",
                f"--port={PORTS['mariadb']}",
                "--skip-name-resolve",
                "--performance-schema=OFF",
                *_MARIADB_SIZES,
            ),
            pidfile=RUN / "mariadb.pid",
            ready=lambda: _unix_socket_answers(DB_SOCKET),
            logs=(LOG / "mariadb.log", LOG / "mariadb.out"),
            port=PORTS["mariadb"],
        ),
        Daemon(
            name="slurmdbd",
            argv=(_bin("slurmdbd"), "-D"),  # reads slurmdbd.conf beside SLURM_CONF
            pidfile=RUN / "slurmdbd.pid",
            ready=lambda: _tcp_answers(PORTS["slurmdbd"]),
            logs=(LOG / "slurmdbd.log", LOG / "slurmdbd.out"),
            port=PORTS["slurmdbd"],
            configs=(ETC / "slurmdbd.conf",),
            timeout_s=60.0,  # creates its tables on the first start
        ),
        Daemon(
            name="slurmctld",
            argv=(_bin("slurmctld"), "-D", "-f", str(SLURM_CONF)),
            pidfile=RUN / "slurmctld.pid",
            ready=lambda: _tcp_answers(PORTS["slurmctld"]),
            logs=(LOG / "slurmctld.log", LOG / "slurmctld.out"),
            port=PORTS["slurmctld"],
            configs=slurm_configs,
        ),
    ]
    for node in NODES:
        name = f"slurmd-{node}"
        daemons.append(
            Daemon(
                name=name,
                # Debian's Slurm is built with MULTIPLE_SLURMD: -N picks the NodeName to be.
                argv=(_bin("slurmd"), "-D", "-f", str(SLURM_CONF), "-N", node),
                pidfile=RUN / f"{name}.pid",
                ready=lambda port=PORTS[name]: _tcp_answers(port),
                logs=(LOG / f"{name}.log", LOG / f"{name}.out"),
                port=PORTS[name],
                configs=slurm_configs,
            )
        )
    daemons.append(
        Daemon(
            name="sshd",
            # sshd refuses to start unless invoked by absolute path; -D keeps it in the foreground.
            argv=(_bin("sshd"), "-D", "-f", str(ETC / "sshd_config"), "-E", str(LOG / "sshd.log")),
            pidfile=RUN / "sshd.pid",
            ready=lambda: _tcp_answers(PORTS["sshd"], banner=b"SSH-"),
            logs=(LOG / "sshd.log", LOG / "sshd.out"),
            port=PORTS["sshd"],
            configs=(ETC / "sshd_config",),
        )
    )
    return daemons


# A small redo log and buffer pool: the accounting database stays tiny.
_MARIADB_SIZES = ("--innodb-log-file-size=8M", "--innodb-buffer-pool-size=32M")


def _daemon_env() -> dict[str, str]:
    """A small, fixed environment: the daemons (and slurmstepd, which inherits it) must not pick up
    whatever the caller's shell or virtualenv had set."""
    return {
        "PATH": _SEARCH_PATH,
        "HOME": pwd.getpwuid(os.getuid()).pw_dir,
        "LANG": "C.UTF-8",
        "SLURM_CONF": str(SLURM_CONF),
    }


START_TRIES = 3
"""Starts of a daemon that exits at once before the testbed gives up: slurmdbd, started the moment its MariaDB
said "ready for connections" while four testbeds started at once on 2 cores, exited with "We should have gotten a
result: 'No error'" and failed every test of that worker (it started at the next try)."""


def _ensure_retrying(d: Daemon) -> bool:
    """_ensure, again (up to START_TRIES) when the daemon exited while starting."""
    for attempt in range(1, START_TRIES + 1):
        try:
            return _ensure(d)
        except TestbedError as exc:
            if attempt == START_TRIES or "while starting" not in str(exc):
                raise
            time.sleep(2.0 * attempt)
    raise AssertionError("unreachable")


def _ensure(d: Daemon) -> bool:
    """Start d unless it already runs; wait until it answers; return whether it was started.

    Raise TestbedError, with what its logs said, when it fails.
    """
    if _alive(d):
        if _wait_until(d.ready, d.timeout_s):
            return False
        raise _failure(d, f"is running (pid {_pidfile_pid(d.pidfile)}) but does not answer")
    if d.port is not None and not _port_free(d.port):
        raise TestbedError(
            f"testbed: {d.name} cannot start: port {d.port} is taken by another "
            f"process (set MESHRUN_TESTBED_{d.name.upper().replace('-', '_')}_PORT)"
        )
    d.pidfile.unlink(missing_ok=True)
    # Logs are appended to across runs: a failure shows only what this start wrote.
    offsets = {path: path.stat().st_size if path.exists() else 0 for path in d.logs}
    pid = _spawn(d.argv, LOG / f"{d.name}.out")
    deadline = time.monotonic() + d.timeout_s
    while not (_pidfile_pid(d.pidfile) == pid and d.ready()):
        status = _exit_status(pid)
        if status is not None:
            raise _failure(d, f"exited with status {status} while starting", offsets)
        if time.monotonic() > deadline:
            _kill(pid)
            raise _failure(d, f"did not answer within {d.timeout_s:.0f} s", offsets)
        time.sleep(_POLL_S)
    return True


def _spawn(argv: tuple[str, ...], out: Path) -> int:
    """Start a daemon detached from the caller; return its pid.

    posix_spawn, not subprocess.Popen: a Popen object of a daemon meant to outlive this process
    warns "subprocess N is still running" when it is garbage-collected. setsid: a Ctrl-C in the
    caller's terminal must not reach the daemons. `env -C /` (it execs: same pid): a daemon's working
    directory must outlive the caller's, or every job step warns "Unable to get current working
    directory" once the folder that started the testbed is gone.
    """
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        return os.posix_spawn(
            "/usr/bin/env",
            ["env", "-C", "/", *argv],
            _daemon_env(),
            setsid=True,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, fd, 1),
                (os.POSIX_SPAWN_DUP2, fd, 2),
            ],
        )
    finally:
        os.close(fd)


def _exit_status(pid: int) -> int | None:
    """pid's exit code if it is our child and has exited (reaping it), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (started by an earlier up()), or already reaped
        return None
    return os.waitstatus_to_exitcode(status) if done == pid else None


def _stop(d: Daemon, timeout_s: float = 15.0) -> None:
    pid = _pidfile_pid(d.pidfile)
    if pid is not None and _alive(d):
        _kill(pid, timeout_s)
    d.pidfile.unlink(missing_ok=True)


def _kill(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after timeout_s; returns once the process is gone or a zombie. Each signal and
    each check is for the process `pid` named when this started (its start time): once it is gone, its pid
    may be another process's (launcher/contract/procs.py does the same for meshrun; this module stays stdlib-only)."""
    started = _start_ticks(pid)

    def running() -> bool:
        return _pid_running(pid) and _start_ticks(pid) == started

    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if started is None or not running():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if _wait_until(lambda: not running(), wait_s):
            return
    raise TestbedError(f"process {pid} survived SIGKILL")


def _start_ticks(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot, /proc/PID/stat field 22), None if none runs."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_running(pid: int) -> bool:
    """True while pid runs. PID 1 on these machines reaps orphans late, so a dead daemon can linger
    as a zombie for which kill(pid, 0) still succeeds: read its state from /proc instead."""
    _exit_status(pid)  # our own child: reap it, so that it does not stay a zombie
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat_line.rsplit(")", 1)[1].split()[0]  # comm, in parentheses, may contain spaces
    return state not in ("Z", "X")


def _alive(d: Daemon) -> bool:
    """Does d's PID file name a live process running d's binary (not a recycled PID)?"""
    pid = _pidfile_pid(d.pidfile)
    if pid is None or not _pid_running(pid):
        return False
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    # Debian installs slurmctld and slurmd as alternatives symlinks to slurmctld-wlm, slurmd-wlm.
    return exe.removesuffix(" (deleted)") == os.path.realpath(d.argv[0])


def _pidfile_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _failure(d: Daemon, what: str, offsets: dict[Path, int] | None = None) -> TestbedError:
    return TestbedError(f"testbed: {d.name} {what}.\n  command: {' '.join(d.argv)}\n" + _log_tails(d.logs, offsets))


def _log_tails(paths: tuple[Path, ...], offsets: dict[Path, int] | None = None, lines: int = 25) -> str:
    """The last lines of each log, of what was written after offsets[path] where given."""
    parts = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                f.seek((offsets or {}).get(path, 0))
                text = f.read().decode(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            continue
        if text:
            parts.append(f"--- last lines of {path} ---\n" + "\n".join(text))
    return "\n".join(parts) or "(no log output)"


# --------------------------------------------------------------------------- probes


def _unix_socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _tcp_answers(port: int, banner: bytes = b"") -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            return not banner or s.recv(len(banner)) == banner
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a socket of a just-stopped daemon in TIME_WAIT does not count as taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _client(*argv: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command against the testbed."""
    return subprocess.run(
        [_bin(argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        env={**os.environ, **client_env()},
        timeout=timeout_s,
        check=False,
    )


# Node states (sinfo %t) of a node whose slurmd has registered and that can run jobs. A trailing
# flag (idle*, idle~, drain...) means it is not responding, powered down or drained.
_USABLE_STATES = frozenset({"idle", "mix", "alloc", "comp"})


def _node_states() -> dict[str, str]:
    res = _client("sinfo", "-h", "-N", "-o", "%N %t")
    return dict(line.split() for line in res.stdout.splitlines() if line.strip()) if res.returncode == 0 else {}


def _accounting_answers() -> bool:
    """sacct works only once slurmdbd answers and knows the cluster (slurmctld registers it)."""
    res = _client("sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster")
    return (
        res.returncode == 0
        and CLUSTER in res.stdout.split()
        and _client("sacct", "-n", "-X", "-o", "JobID").returncode == 0
    )


def _healthy(daemons: list[Daemon]) -> bool:
    states = _node_states()
    return (
        all(d.ready() for d in daemons)
        and all(states.get(n) in _USABLE_STATES for n in NODES)
        and _accounting_answers()
        and HOSTS_LINE in _hosts_lines()
    )


def _wait_cluster_ready(timeout_s: float = 30.0) -> None:
    def nodes_usable() -> bool:
        states = _node_states()
        return all(states.get(n) in _USABLE_STATES for n in NODES)

    if not _wait_until(nodes_usable, timeout_s):
        sinfo = _client("sinfo", "-N", "-l")
        raise TestbedError(
            f"testbed: nodes {', '.join(NODES)} did not become idle within {timeout_s:.0f} s.\n"
            f"sinfo: {sinfo.stdout}{sinfo.stderr}\n"
            + _log_tails(tuple(LOG / f"{n}.log" for n in ("slurmctld", *(f"slurmd-{x}" for x in NODES))))
        )
    if not _wait_until(_accounting_answers, timeout_s):
        sacct = _client("sacct", "-n", "-X")
        raise TestbedError(
            f"testbed: accounting (sacct) does not answer within {timeout_s:.0f} s: "
            f"{sacct.stdout}{sacct.stderr}\n" + _log_tails((LOG / "slurmdbd.log", LOG / "slurmctld.log"))
        )


# --------------------------------------------------------------------------- files


def _preflight() -> None:
    if os.geteuid() != 0:
        raise TestbedError("testbed: must run as root (mknod, /etc/hosts, sshd)")
    missing = missing_binaries()
    if missing:
        raise TestbedError(f"testbed: missing {', '.join(missing)}; run `sh tests/testbed/install.sh` (as root) first")
    if any(c.isspace() for c in str(TESTBED_DIR)):
        raise TestbedError(f"testbed: {TESTBED_DIR} contains whitespace; Slurm configs cannot hold it")


def _make_dirs() -> None:
    # munged refuses a socket whose folder, or any folder above it, others cannot traverse
    # ("Socket is inaccessible"); a mktemp -d folder is 0700. Add o+x (and g+x) to the parents
    # without taking anything away: /tmp must keep its sticky, world-writable mode.
    for parent in reversed(TESTBED_DIR.parents):
        if parent.exists():
            mode = stat.S_IMODE(parent.stat().st_mode)
            if mode & 0o011 != 0o011:
                parent.chmod(mode | 0o011)
    for d in (TESTBED_DIR, ETC, RUN, LOG, MUNGE, DB, STATE, SPOOL, DEV, SSH, *(SPOOL / n for n in NODES)):
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)
    # sshd's privilege separation folder; /run is a tmpfs, so it vanishes on reboot.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Serialise up()/down() between processes (e.g. two pytest sessions starting at once)."""
    with open(TESTBED_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write text unless the file already holds it; return whether it changed."""
    try:
        if path.read_text() == text:
            path.chmod(mode)
            return False
    except FileNotFoundError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)
    return True


def _write_static_files() -> None:
    """Keys and device nodes: made once, kept across down()/up()."""
    key = MUNGE / "munge.key"
    if not key.exists():
        _run(_bin("mungekey"), "-c", "-b", "1024", "-k", str(key))
    key.chmod(0o600)  # munged refuses a key others can read
    # Fake GPUs. gres.conf File= must name character devices (plain files are rejected); 195 is
    # the NVIDIA major. Nothing ever opens them: Slurm only uses them to set CUDA_VISIBLE_DEVICES.
    for node in NODES:
        for i in range(GPUS_PER_NODE):
            dev = DEV / f"{node}-gpu{i}"
            if not (dev.exists() and stat.S_ISCHR(dev.stat().st_mode)):
                dev.unlink(missing_ok=True)
                _run(_bin("mknod"), str(dev), "c", "195", str(i))
    for path, comment in ((SSH_HOST_KEY, "meshrun-testbed-host"), (SSH_CLIENT_KEY, "meshrun-testbed-client")):
        if not path.exists():
            _run(_bin("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


def _write_configs() -> set[Path]:
    """(Re)write the config files; return those whose content changed."""
    files = {
        SLURM_CONF: (_slurm_conf(), 0o644),
        ETC / "gres.conf": (_gres_conf(), 0o644),
        ETC / "slurmdbd.conf": (_slurmdbd_conf(), 0o600),  # slurmdbd refuses anything looser
        ETC / "sshd_config": (_sshd_config(), 0o644),
        SSH_AUTHORIZED_KEYS: (Path(f"{SSH_CLIENT_KEY}.pub").read_text(), 0o600),
        SSH_KNOWN_HOSTS: (_known_hosts_line(), 0o644),
    }
    return {path for path, (text, mode) in files.items() if _write(path, text, mode)}


def _short_hostname() -> str:
    return socket.gethostname().split(".")[0]


def _slurm_conf() -> str:
    host = _short_hostname()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={PORTS[f'slurmd-{n}']} "
        f"CPUs={CPUS_PER_NODE} RealMemory=2000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN"
        for n in NODES
    )
    return f"""\
# Written by tests/testbed/testbed.py; rewritten by every up().
ClusterName={CLUSTER}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={PORTS["slurmctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5 (Slurm's least): a requeued job may start again 6 s after its requeue (cred_expire + 1) instead of
# ~121 s; a step's credential is still good for 5 s, which srun's launch here takes a fraction of.
AuthInfo=socket={MUNGE_SOCKET},cred_expire=5
StateSaveLocation={STATE}
SlurmdSpoolDir={SPOOL}/%n
SlurmctldPidFile={RUN}/slurmctld.pid
SlurmdPidFile={RUN}/slurmd-%n.pid
SlurmctldLogFile={LOG}/slurmctld.log
SlurmdLogFile={LOG}/slurmd-%n.log
# No cgroups on these machines.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={PORTS["slurmdbd"]}
# Not a password: connections to slurmdbd ignore AuthInfo=socket= and take the munge socket from here.
AccountingStoragePass={MUNGE_SOCKET}
AccountingStorageTRES=gres/gpu
# Store every batch script and job environment, as sites with slurmdbd often do: the secrets test
# greps them (sacct --batch-script / --env-vars) for a value that must never reach them.
AccountingStoreFlags=job_script,job_env
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Lets a node claim more CPUs than this machine has.
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
FirstJobId={FIRST_JOB_ID}
# After a scancel the ranks save, the sidecar stops and the batch shell decides, all before the SIGKILL
# that follows KillWait seconds later. Slurm's default is 30; 5 was too short on a loaded 2-core CI machine.
KillWait=15
GresTypes=gpu
{nodes}
# Real preemption (tests/integration/test_real_preemption.py): a job in {HIGH_PARTITION} takes the nodes of
# a {PARTITION} job, which Slurm signals (SIGTERM), gives GRACE_TIME_S to save, then requeues itself.
# The default partition is the low one; jobs in one tier never preempt each other.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName={PARTITION} Nodes={",".join(PARTITION_NODES)} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_TIME_S}
PartitionName={HIGH_PARTITION} Nodes={",".join(PARTITION_NODES)} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
PartitionName={WIDE_PARTITION} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 GraceTime={GRACE_TIME_S}
"""


def _gres_conf() -> str:
    last = GPUS_PER_NODE - 1
    return "".join(f"NodeName={n} Name=gpu File={DEV}/{n}-gpu[0-{last}]\n" for n in NODES)


def _slurmdbd_conf() -> str:
    return f"""\
# Written by tests/testbed/testbed.py; rewritten by every up().
AuthType=auth/munge
AuthInfo=socket={MUNGE_SOCKET}
DbdHost={_short_hostname()}
DbdAddr=127.0.0.1
DbdPort={PORTS["slurmdbd"]}
SlurmUser=root
PidFile={RUN}/slurmdbd.pid
LogFile={LOG}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={PORTS["mariadb"]}
StorageUser={DB_USER}
StoragePass={DB_PASSWORD}
StorageLoc=slurm_acct_db
"""


def _sshd_config() -> str:
    return f"""\
# Written by tests/testbed/testbed.py; rewritten by every up().
Port {PORTS["sshd"]}
ListenAddress 127.0.0.1
HostKey {SSH_HOST_KEY}
PidFile {RUN}/sshd.pid
AuthorizedKeysFile {SSH_AUTHORIZED_KEYS}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
# The testbed lives under /tmp, which is world-writable.
StrictModes no
AllowTcpForwarding yes
Subsystem sftp internal-sftp
# Every session, like a login node's, reaches the testbed's Slurm.
SetEnv SLURM_CONF={SLURM_CONF}
"""


def _known_hosts_line() -> str:
    key_type, key = Path(f"{SSH_HOST_KEY}.pub").read_text().split()[:2]
    port = PORTS["sshd"]
    host = "127.0.0.1" if port == 22 else f"[127.0.0.1]:{port}"
    return f"{host} {key_type} {key}\n"


def _init_database() -> None:
    """Create MariaDB's system tables once. Built aside and renamed, so a failed attempt is redone."""
    if DB_DATA.is_dir():
        return
    tmp = DB / "data.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    log = LOG / "mariadb-install-db.log"
    with open(log, "w") as out:
        res = subprocess.run(
            [
                _bin("mariadb-install-db"),
                "--no-defaults",
                "--user=root",
                f"--datadir={tmp}",
                "--skip-test-db",
                "--auth-root-authentication-method=socket",
                *_MARIADB_SIZES,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_daemon_env(),
            check=False,
        )
    if res.returncode != 0:
        raise TestbedError(f"testbed: mariadb-install-db failed ({res.returncode}).\n" + _log_tails((log,)))
    tmp.rename(DB_DATA)


def _grant_slurm_user() -> None:
    sql = (
        f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASSWORD}'; "
        f"GRANT ALL ON slurm_acct_db.* TO '{DB_USER}'@'127.0.0.1';"
    )
    # Root logs in through the socket as the OS user root (install-db's socket auth).
    res = subprocess.run(
        [_bin("mariadb"), "--no-defaults", "-S", str(DB_SOCKET), "-uroot", "-e", sql],
        capture_output=True,
        text=True,
        env=_daemon_env(),
        check=False,
    )
    if res.returncode != 0:
        raise TestbedError(f"testbed: could not create the slurm database user: {res.stderr}")


def _hosts_lines() -> list[str]:
    return HOSTS_FILE.read_text().splitlines()


def _add_hosts_line() -> None:
    """Make the node names resolve (MASTER_ADDR=n1). /etc/hosts is edited in place, not replaced:
    in containers it is often a bind mount that cannot be renamed over."""
    text = HOSTS_FILE.read_text()
    if HOSTS_LINE in text.splitlines():
        return
    with open(HOSTS_FILE, "a") as f:
        f.write(("" if text.endswith("\n") or not text else "\n") + HOSTS_LINE + "\n")


def _remove_hosts_line() -> None:
    lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.rstrip("\n") != HOSTS_LINE]
    if kept != lines:
        with open(HOSTS_FILE, "r+") as f:
            f.write("".join(kept))
            f.truncate()


# --------------------------------------------------------------------------- jobs left behind


def _cancel_all_jobs(timeout_s: float = 20.0) -> None:
    """Cancel every job still queued or running, so that no slurmstepd or task outlives down()."""

    def job_ids() -> list[str]:
        return _client("squeue", "-h", "-o", "%A").stdout.split()

    ids = job_ids()
    if ids:
        _client("scancel", *ids)
        _wait_until(lambda: not job_ids(), timeout_s)


def _kill_stray_steps() -> None:
    """Kill slurmstepd processes of this testbed, and their tasks, that survived their slurmd.

    They are told apart from other clusters' by the SLURM_CONF they inherited from our slurmd.
    """
    marker = f"SLURM_CONF={SLURM_CONF}".encode()
    children: dict[int, list[int]] = {}
    steps: list[int] = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat_fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(stat_fields[1]), []).append(int(proc.name))
            if (proc / "comm").read_text().strip() == "slurmstepd" and marker in (proc / "environ").read_bytes().split(
                b"\0"
            ):
                steps.append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
    doomed: dict[int, int | None] = {}  # pid -> its start time when found: a pid freed meanwhile is left alone
    todo = list(steps)
    while todo:
        pid = todo.pop()
        doomed[pid] = _start_ticks(pid)
        todo.extend(children.get(pid, []))
    for pid, started in doomed.items():
        if started is not None and _start_ticks(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for pid, started in doomed.items():
        _wait_until(lambda pid=pid, started=started: not (_pid_running(pid) and _start_ticks(pid) == started), 5.0)


# --------------------------------------------------------------------------- helpers


def _which(name: str) -> str | None:
    return shutil.which(name, path=f"{_SEARCH_PATH}:{os.environ.get('PATH', '')}")


def _bin(name: str) -> str:
    """name's absolute path. up() checks first that all are installed; down() and status() must
    work without them (nothing of ours can run then), so a missing one is left for exec to report."""
    return _which(name) or name


def _run(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise TestbedError(f"testbed: {' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.testbed.testbed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=("up", "down", "status", "env", "profile"))
    parser.add_argument("name", nargs="?", default="mycluster", help="profile: the cluster profile's name")
    parser.add_argument("--purge", action="store_true", help="down: also delete the testbed folder")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        if args.command == "up":
            print(json.dumps(up(), indent=2))
        elif args.command == "down":
            down(purge=args.purge)
        elif args.command == "status":
            pids = status()
            for name, pid in pids.items():
                print(f"{name:10} {'running, pid ' + str(pid) if pid else 'stopped'}")
            return 0 if all(pids.values()) else 1
        elif args.command == "profile":
            # A profile reaching this testbed over SSH, as a laptop would (its host key already trusted).
            from meshrun.launcher.contract.private import make_private_dir
            from tests.helpers import sshbed

            meshrun_config = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "meshrun"
            clusters = meshrun_config / "clusters"
            for folder in (meshrun_config, clusters):  # private whatever the umask: it names the key file
                make_private_dir(str(folder))
            print(sshbed.profile(clusters, name=args.name))
            return 0
        else:
            # The profile `testbed`'s setup line activates MESHRUN_TESTBED_VENV: this interpreter's venv.
            for key, value in {**client_env(), "MESHRUN_TESTBED_VENV": sys.prefix}.items():
                print(f"export {key}={shlex.quote(value)}")
            return 0
    except TestbedError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"testbed {args.command}: {time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
