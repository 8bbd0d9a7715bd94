"""Where this rank stands: rank, world, node, master address and port. Torch-free, stdlib-only.

`rank_env` is the one entry point that reads the environment, and it reads only the mapping
it is handed (submitit's `SlurmJobEnvironment._env` idea), so each source is a recorded dict
in the tests. Sources, innermost launcher first:

- "torchrun": RANK, WORLD_SIZE and MASTER_ADDR are all set; they are kept as they are.
- "local":    submitit's LocalExecutor task (SUBMITIT_LOCAL_*); master 127.0.0.1.
- "slurm":    an srun step (SLURM_PROCID, ...); master = first host of the step's node list.
- "single":   none of these: one process.

"local" is checked before "slurm" on purpose: an interactive `srun --pty bash` shell carries
SLURM_PROCID=0, and LocalExecutor tasks started from it inherit that, so with Slurm first
every local task would believe it is rank 0 of 1.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Optional

from meshrun.launcher.contract.records.rundir import IN_JOB_ENV
from meshrun.launcher.rank.hostlist import expand_hostlist

__all__ = ["RankEnv", "rank_env", "torchrun_vars", "setdefault_env", "master_port", "expand_hostlist"]

LOCAL_ADDR = "127.0.0.1"

# MASTER_PORT window: at or above 20000 (clear of well-known and most registered service ports)
# and below 32768, where Linux's default ephemeral range (32768-60999) starts, so an outgoing
# connection can never be holding the port. 29500 (torchrun's default) is skipped.
PORT_LOW = 20000
PORT_HIGH = 32767
_TORCHRUN_DEFAULT_PORT = 29500

# The torchrun variables a non-torchrun source must agree with when the user has set any.
_TORCHRUN_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the job, as `rank_env` read it."""

    rank: int
    """Global rank of this process, 0 <= rank < world_size."""
    local_rank: int
    """Rank among the processes on this node; selects the GPU."""
    world_size: int
    """Number of processes in the job step."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node in the step, 0 <= node_rank < num_nodes."""
    num_nodes: int
    """Number of nodes in the step."""
    master_addr: str
    """Where rank 0's rendezvous store listens: MASTER_ADDR if set, else the first host."""
    master_port: int
    """Rendezvous port: MASTER_PORT if the user set it, else `master_port(job_id)`."""
    job_id: str
    """Scheduler job id ("" when there is none); the same on every rank and across requeues."""
    restart_count: int
    """How many times the job was requeued/restarted before this run (SLURM_RESTART_COUNT)."""
    hosts: tuple[str, ...]
    """Node names of the step, in Slurm's order; empty when the source does not tell."""
    source: str
    """Where the values came from: "slurm", "local", "torchrun" or "single"."""


def rank_env(environ: Mapping[str, str]) -> RankEnv:
    """This rank's view of the job, from `environ`; ValueError names any inconsistent variable."""
    if all(name in environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return _from_torchrun(environ)
    if "SUBMITIT_LOCAL_GLOBALID" in environ:
        return _checked_against_torchrun_vars(_from_local(environ), environ)
    if "SLURM_PROCID" in environ:
        return _checked_against_torchrun_vars(_from_slurm(environ), environ)
    return _checked_against_torchrun_vars(_from_single(environ), environ)


def torchrun_vars(r: RankEnv) -> dict[str, str]:
    """The variables torchrun would give this rank (TORCHELASTIC_* left out: there is no agent)."""
    return {
        "RANK": str(r.rank),
        "WORLD_SIZE": str(r.world_size),
        "LOCAL_RANK": str(r.local_rank),
        "LOCAL_WORLD_SIZE": str(r.local_world_size),
        "GROUP_RANK": str(r.node_rank),
        "GROUP_WORLD_SIZE": str(r.num_nodes),
        "ROLE_RANK": str(r.rank),
        "ROLE_WORLD_SIZE": str(r.world_size),
        "NODE_RANK": str(r.node_rank),
        "MASTER_ADDR": r.master_addr,
        "MASTER_PORT": str(r.master_port),
    }


def setdefault_env(updates: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set the keys of `updates` that `environ` lacks ("" counts as set); return what was set."""
    added = {key: value for key, value in updates.items() if key not in environ}
    environ.update(added)
    return added


START_STRIDE = 7919
"""How far apart (modulo the window) the ports of one job's successive starts are: a prime, so every start of a
job gets its own port, and a start's port lands far from the ports of the jobs with ids near its own."""


def master_port(job_id: str, start: int = 0) -> int:
    """A port in [PORT_LOW, PORT_HIGH] that is the same for every rank of one start of `job_id`.

    Numeric ids (Slurm's, a LocalExecutor pid) map by modulo, so jobs with nearby ids, the
    ones likely to share a node at the same time, never get the same port; other ids hash.
    Each start (`start`: a requeue, a restart inside the allocation) moves it by START_STRIDE: a port still
    held by a dying earlier start of the same job (its TCPStore, in TIME_WAIT) cannot stall the next one's
    rendezvous (a new user's trial lost 42 s to that after a requeue).
    """
    span = PORT_HIGH - PORT_LOW  # one port fewer than the window: 29500 is skipped below
    if job_id.isascii() and job_id.isdigit():
        slot = int(job_id) % span
    else:  # sha256, not hash(): str hashes are salted per process, and all ranks must agree
        slot = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") % span
    slot = (slot + start * START_STRIDE) % span
    port = PORT_LOW + slot
    return port + 1 if port >= _TORCHRUN_DEFAULT_PORT else port


# ---- the sources --------------------------------------------------------------------------


def _from_torchrun(env: Mapping[str, str]) -> RankEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    _check_below("RANK", rank, "WORLD_SIZE", world)
    # RANK/WORLD_SIZE/MASTER_ADDR exported by hand inside srun often come without LOCAL_RANK:
    # the scheduler's view then fills the gaps, when it counts the same ranks.
    under = _scheduler_view(env, rank, world)
    if under is None and "LOCAL_WORLD_SIZE" not in env and env.get("LOCAL_RANK", "0") != "0":
        raise ValueError(f"LOCAL_RANK={env['LOCAL_RANK']} is set but LOCAL_WORLD_SIZE is not; set it too")
    local = _int(env, "LOCAL_RANK", default=under.local_rank if under else 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", default=under.local_world_size if under else 1)
    _check_below("LOCAL_RANK", local, "LOCAL_WORLD_SIZE", local_world)
    if "GROUP_WORLD_SIZE" in env:
        nodes = _int(env, "GROUP_WORLD_SIZE")
    elif under:
        nodes = under.num_nodes
    elif world % local_world == 0:
        nodes = world // local_world
    else:
        raise ValueError(
            f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}; "
            "set GROUP_WORLD_SIZE to the number of nodes"
        )
    node = _int(env, "GROUP_RANK", default=under.node_rank if under else rank // local_world)
    _check_below("GROUP_RANK", node, "GROUP_WORLD_SIZE", nodes)
    # The job ids in source order (local before slurm, see the module docstring), so that
    # re-reading the variables a rank exported gives the same job id, hence the same port.
    job_id = _text(env, "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID", "SLURM_JOBID", "TORCHELASTIC_RUN_ID", default="")
    nodelist = _lookup(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    return RankEnv(
        rank=rank,
        local_rank=local,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=_master_addr(env, ""),
        master_port=_master_port(env, job_id),
        job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", default=0),
        hosts=_hosts(*nodelist) if nodelist else (),
        source="torchrun",
    )


def _scheduler_view(env: Mapping[str, str], rank: int, world: int) -> Optional[RankEnv]:
    """The LocalExecutor's or Slurm's view of this process, if it has the same rank and world."""
    try:
        if "SUBMITIT_LOCAL_GLOBALID" in env:
            view = _from_local(env)
        elif "SLURM_PROCID" in env:
            view = _from_slurm(env)
        else:
            return None
    except ValueError:  # an inconsistent view fills no gaps; RANK and co. stand on their own
        return None
    return view if (view.rank, view.world_size) == (rank, world) else None


def _from_local(env: Mapping[str, str]) -> RankEnv:
    rank, world = _int(env, "SUBMITIT_LOCAL_GLOBALID"), _int(env, "SUBMITIT_LOCAL_NTASKS")
    local, node = _int(env, "SUBMITIT_LOCAL_LOCALID"), _int(env, "SUBMITIT_LOCAL_NODEID", default=0)
    nodes = _int(env, "SUBMITIT_LOCAL_JOB_NUM_NODES", default=1)
    if nodes != 1:
        raise ValueError(f"SUBMITIT_LOCAL_JOB_NUM_NODES={nodes}: the LocalExecutor runs one node")
    _check_below("SUBMITIT_LOCAL_GLOBALID", rank, "SUBMITIT_LOCAL_NTASKS", world)
    _check_below("SUBMITIT_LOCAL_LOCALID", local, "SUBMITIT_LOCAL_NTASKS", world)
    _check_below("SUBMITIT_LOCAL_NODEID", node, "SUBMITIT_LOCAL_JOB_NUM_NODES", nodes)
    job_id = _text(env, "SUBMITIT_LOCAL_JOB_ID", default="")
    addr = _master_addr(env, LOCAL_ADDR)
    return RankEnv(
        rank=rank,
        local_rank=local,
        world_size=world,
        local_world_size=world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=addr,
        master_port=_master_port(env, job_id),
        job_id=job_id,
        restart_count=0,
        hosts=(LOCAL_ADDR,),
        source="local",
    )


def _from_slurm(env: Mapping[str, str]) -> RankEnv:
    # Step variables first: a step may use fewer nodes/tasks than the job (`srun -N1` in a
    # 2-node allocation), and SLURM_PROCID/SLURM_NODEID count within the step.
    world_var = _require(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    nodes_var = _require(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    list_var = _require(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    rank, world, nodes = _int(env, "SLURM_PROCID"), _int(env, world_var), _int(env, nodes_var)
    node, local = _int(env, "SLURM_NODEID"), _int(env, "SLURM_LOCALID")
    _check_below("SLURM_PROCID", rank, world_var, world)
    _check_below("SLURM_NODEID", node, nodes_var, nodes)
    hosts = _hosts(list_var, env[list_var])
    if len(hosts) != nodes:
        raise ValueError(f"{list_var}={env[list_var]!r} names {len(hosts)} host(s) but {nodes_var}={nodes}")
    node_name = env.get("SLURMD_NODENAME")
    if node_name is not None and node_name not in hosts:
        raise ValueError(f"SLURMD_NODENAME={node_name!r} is not in {list_var}={env[list_var]!r}")
    local_world = _tasks_on_node(env, node, nodes, world)
    _check_below("SLURM_LOCALID", local, f"the tasks on node {node}", local_world)
    job_id = _require_text(env, "SLURM_JOB_ID", "SLURM_JOBID")
    return RankEnv(
        rank=rank,
        local_rank=local,
        world_size=world,
        local_world_size=local_world,
        node_rank=node,
        num_nodes=nodes,
        master_addr=_master_addr(env, hosts[0]),
        master_port=_master_port(env, job_id),
        job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", default=0),
        hosts=hosts,
        source="slurm",
    )


def _from_single(env: Mapping[str, str]) -> RankEnv:
    job_id = _text(env, "SLURM_JOB_ID", "SLURM_JOBID", default="")
    addr = _master_addr(env, LOCAL_ADDR)
    return RankEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr=addr,
        master_port=_master_port(env, job_id),
        job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", default=0),
        hosts=(addr,),
        source="single",
    )


def _checked_against_torchrun_vars(r: RankEnv, env: Mapping[str, str]) -> RankEnv:
    """A stray RANK/WORLD_SIZE/... that disagrees would reach torch unchanged: refuse it."""
    ours = torchrun_vars(r)
    for name in _TORCHRUN_RANK_VARS:
        if name in env and env[name] != ours[name]:
            raise ValueError(
                f"{name}={env[name]!r} is set, but the {r.source} environment says "
                f"{name}={ours[name]}; unset it, or also set RANK, WORLD_SIZE and "
                "MASTER_ADDR to use your own values throughout"
            )
    return r


# ---- small readers: every error names the variable and its value ---------------------------


def _lookup(env: Mapping[str, str], *names: str) -> Optional[tuple[str, str]]:
    """The first of `names` that is set, with its value."""
    return next(((name, env[name]) for name in names if name in env), None)


def _require(env: Mapping[str, str], *names: str) -> str:
    """The first of `names` that is set; ValueError listing them all when none is."""
    found = _lookup(env, *names)
    if found is None:
        raise ValueError(f"SLURM_PROCID is set but none of {', '.join(names)} is; is this running under srun?")
    return found[0]


def _require_text(env: Mapping[str, str], *names: str) -> str:
    return env[_require(env, *names)]


def _text(env: Mapping[str, str], *names: str, default: str) -> str:
    found = _lookup(env, *names)
    return default if found is None else found[1]


def _int(env: Mapping[str, str], *names: str, default: Optional[int] = None) -> int:
    """The first of `names` that is set, as a non-negative integer."""
    found = _lookup(env, *names)
    if found is None:
        if default is None:
            raise ValueError(f"{names[0]} is not set")
        return default
    name, value = found
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{name}={value!r} is not a non-negative integer")
    return int(value)


def _check_below(index_name: str, index: int, size_name: str, size: int) -> None:
    if size < 1:
        raise ValueError(f"{size_name}={size}: must be at least 1")
    if index >= size:
        raise ValueError(f"{index_name}={index} must be below {size_name}={size}")


def _master_addr(env: Mapping[str, str], default: str) -> str:
    addr = env.get("MASTER_ADDR", default)
    if not addr:
        raise ValueError("MASTER_ADDR is set but empty; unset it or give a host")
    return addr


def start_index(env: Mapping[str, str]) -> int:
    """Which start of its job this is, the same on every rank: Slurm's requeues and the restarts inside the
    allocation (spare nodes) together."""
    try:
        requeues = int(env.get("SLURM_RESTART_COUNT") or 0)
        in_job = int(env.get(IN_JOB_ENV) or 0)
    except ValueError:
        return 0
    return requeues * 1009 + in_job  # 1009: more restarts than any allocation makes inside itself


def _master_port(env: Mapping[str, str], job_id: str) -> int:
    port = _int(env, "MASTER_PORT", default=master_port(job_id, start_index(env)))
    if not 1 <= port <= 65535:
        raise ValueError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port (1-65535)")
    return port


def _hosts(name: str, value: str) -> tuple[str, ...]:
    try:
        hosts = tuple(expand_hostlist(value))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if not hosts:
        raise ValueError(f"{name}={value!r} names no host")
    return hosts


_TASKS_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


def _tasks_on_node(env: Mapping[str, str], node: int, nodes: int, world: int) -> int:
    """Tasks on node `node`: from Slurm's per-node counts ("2(x3),1"), else an even split."""
    found = _lookup(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is not None:
        counts = _parse_tasks_per_node(*found)
    elif "SLURM_NTASKS_PER_NODE" in env:  # the --ntasks-per-node request: same on every node
        found = ("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS_PER_NODE"])
        counts = [(_int(env, "SLURM_NTASKS_PER_NODE"), nodes)]
    elif world % nodes:
        raise ValueError(
            f"{world} tasks do not split evenly over {nodes} nodes and SLURM_STEP_TASKS_PER_NODE is not set"
        )
    else:
        return world // nodes
    if sum(reps for _, reps in counts) != nodes or sum(n * reps for n, reps in counts) != world:
        raise ValueError(f"{found[0]}={found[1]!r} does not describe {world} tasks on {nodes} nodes")
    for tasks, reps in counts:
        if node < reps:
            return tasks
        node -= reps
    raise AssertionError("unreachable: the counts cover `nodes` nodes and node < nodes")


def _parse_tasks_per_node(name: str, value: str) -> list[tuple[int, int]]:
    """ "2(x3),1" -> [(2, 3), (1, 1)]: (tasks, number of consecutive nodes with that many)."""
    counts = []
    for item in value.split(","):
        match = _TASKS_ITEM.fullmatch(item)
        if not match:
            raise ValueError(f"{name}={value!r}: {item!r} is not N or N(xM)")
        counts.append((int(match[1]), int(match[2] or 1)))
    return counts
