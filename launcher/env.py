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
import itertools
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, MutableMapping, Optional

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
    """Where rank 0's rendezvous store listens: MASTER_ADDR if the user set it, else the first host."""
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
        "RANK": str(r.rank), "WORLD_SIZE": str(r.world_size),
        "LOCAL_RANK": str(r.local_rank), "LOCAL_WORLD_SIZE": str(r.local_world_size),
        "GROUP_RANK": str(r.node_rank), "GROUP_WORLD_SIZE": str(r.num_nodes),
        "ROLE_RANK": str(r.rank), "ROLE_WORLD_SIZE": str(r.world_size),
        "NODE_RANK": str(r.node_rank),
        "MASTER_ADDR": r.master_addr, "MASTER_PORT": str(r.master_port),
    }


def setdefault_env(updates: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set each key of `updates` that `environ` lacks (a key set to "" counts as set); return those."""
    added = {key: value for key, value in updates.items() if key not in environ}
    environ.update(added)
    return added


def master_port(job_id: str) -> int:
    """A port in [PORT_LOW, PORT_HIGH] that is the same for every rank of `job_id`.

    Numeric ids (Slurm's, a LocalExecutor pid) map by modulo, so jobs with nearby ids, the
    ones likely to share a node at the same time, never get the same port; other ids hash.
    """
    span = PORT_HIGH - PORT_LOW  # one port fewer than the window: 29500 is skipped below
    if job_id.isascii() and job_id.isdigit():
        slot = int(job_id) % span
    else:  # sha256, not hash(): str hashes are salted per process, and all ranks must agree
        slot = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "big") % span
    port = PORT_LOW + slot
    return port + 1 if port >= _TORCHRUN_DEFAULT_PORT else port


# ---- the sources --------------------------------------------------------------------------

def _from_torchrun(env: Mapping[str, str]) -> RankEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local, local_world = _int(env, "LOCAL_RANK", default=0), _int(env, "LOCAL_WORLD_SIZE", default=1)
    _check_below("RANK", rank, "WORLD_SIZE", world)
    if "LOCAL_WORLD_SIZE" not in env and local > 0:
        raise ValueError(f"LOCAL_RANK={local} is set but LOCAL_WORLD_SIZE is not; set it too")
    _check_below("LOCAL_RANK", local, "LOCAL_WORLD_SIZE", local_world)
    if "GROUP_WORLD_SIZE" in env:
        nodes = _int(env, "GROUP_WORLD_SIZE")
    elif world % local_world == 0:
        nodes = world // local_world
    else:
        raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}; "
                         "set GROUP_WORLD_SIZE to the number of nodes")
    node = _int(env, "GROUP_RANK", default=rank // local_world)
    _check_below("GROUP_RANK", node, "GROUP_WORLD_SIZE", nodes)
    # The job ids in source order (local before slurm, see the module docstring), so that
    # re-reading the variables a rank exported gives the same job id, hence the same port.
    job_id = _text(env, "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID", "SLURM_JOBID",
                   "TORCHELASTIC_RUN_ID", default="")
    nodelist = _lookup(env, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    return RankEnv(
        rank=rank, local_rank=local, world_size=world, local_world_size=local_world,
        node_rank=node, num_nodes=nodes, master_addr=_master_addr(env, ""),
        master_port=_master_port(env, job_id), job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", default=0),
        hosts=_hosts(*nodelist) if nodelist else (), source="torchrun")


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
        rank=rank, local_rank=local, world_size=world, local_world_size=world, node_rank=node,
        num_nodes=nodes, master_addr=addr, master_port=_master_port(env, job_id), job_id=job_id,
        restart_count=0, hosts=(LOCAL_ADDR,), source="local")


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
        raise ValueError(f"{list_var}={env[list_var]!r} names {len(hosts)} host(s) "
                         f"but {nodes_var}={nodes}")
    node_name = env.get("SLURMD_NODENAME")
    if node_name is not None and node_name not in hosts:
        raise ValueError(f"SLURMD_NODENAME={node_name!r} is not in {list_var}={env[list_var]!r}")
    local_world = _tasks_on_node(env, node, nodes, world)
    _check_below("SLURM_LOCALID", local, f"the tasks on node {node}", local_world)
    job_id = _require_text(env, "SLURM_JOB_ID", "SLURM_JOBID")
    return RankEnv(
        rank=rank, local_rank=local, world_size=world, local_world_size=local_world,
        node_rank=node, num_nodes=nodes, master_addr=_master_addr(env, hosts[0]),
        master_port=_master_port(env, job_id), job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", default=0), hosts=hosts, source="slurm")


def _from_single(env: Mapping[str, str]) -> RankEnv:
    job_id = _text(env, "SLURM_JOB_ID", "SLURM_JOBID", default="")
    addr = _master_addr(env, LOCAL_ADDR)
    return RankEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
        master_addr=addr, master_port=_master_port(env, job_id), job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", default=0), hosts=(addr,), source="single")


def _checked_against_torchrun_vars(r: RankEnv, env: Mapping[str, str]) -> RankEnv:
    """A stray RANK/WORLD_SIZE/... that disagrees would reach torch unchanged: refuse it."""
    ours = torchrun_vars(r)
    for name in _TORCHRUN_RANK_VARS:
        if name in env and env[name] != ours[name]:
            raise ValueError(f"{name}={env[name]!r} is set, but the {r.source} environment says "
                             f"{name}={ours[name]}; unset it, or also set RANK, WORLD_SIZE and "
                             "MASTER_ADDR to use your own values throughout")
    return r


# ---- small readers: every error names the variable and its value ---------------------------

def _lookup(env: Mapping[str, str], *names: str) -> Optional[tuple[str, str]]:
    """The first of `names` that is set, with its value."""
    return next(((name, env[name]) for name in names if name in env), None)


def _require(env: Mapping[str, str], *names: str) -> str:
    """The first of `names` that is set; ValueError listing them all when none is."""
    found = _lookup(env, *names)
    if found is None:
        raise ValueError(f"SLURM_PROCID is set but none of {', '.join(names)} is; "
                         "is this running under srun?")
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


def _master_port(env: Mapping[str, str], job_id: str) -> int:
    port = _int(env, "MASTER_PORT", default=master_port(job_id))
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
        raise ValueError(f"{world} tasks do not split evenly over {nodes} nodes and "
                         "SLURM_STEP_TASKS_PER_NODE is not set")
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
    """"2(x3),1" -> [(2, 3), (1, 1)]: (tasks, number of consecutive nodes with that many)."""
    counts = []
    for item in value.split(","):
        match = _TASKS_ITEM.fullmatch(item)
        if not match:
            raise ValueError(f"{name}={value!r}: {item!r} is not N or N(xM)")
        counts.append((int(match[1]), int(match[2] or 1)))
    return counts


# ---- Slurm hostlists ----------------------------------------------------------------------
# A port of Slurm's src/common/hostlist.c (_next_tok, _parse_single_range, _push_range_list,
# _hostlist_create_bracketed) as of Slurm 23.11+, where a suffix may follow the last bracket
# ("n[1-2]-ib") and an unclosed '[' is an error; 22.05 rejected the first and mangled the
# second into a name ending in "]". Quirks are kept where they change no sane input: widths
# come from the low bound's text ("n[1-010]" -> n1..n10, "n[ 1-3]" -> n01..n03), and groups
# before the last bracket nest right to left ("a[1-2]b[3-4]c[5]": a1b3c5 a2b3c5 a1b4c5 ...).
# Stricter than Slurm on purpose (it logs, mangles or drops where we raise): a name that would
# keep a '[' or ']', control characters, numbers >= 2**64-1, a bad bracket group far from the
# last one (Slurm drops those hosts silently), and more than _MAX_HOSTS hosts in all.

_SEPARATOR = re.compile(r"[\t\n ,]")
_SEPARATORS = re.compile(r"[\t\n ,]*")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_PLAIN_LIST = re.compile(r"[0-9]{1,19}(?:-[0-9]{1,19})?(?:,[0-9]{1,19}(?:-[0-9]{1,19})?)*")
_STRTOUL = re.compile(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)")  # C strtoul, base 10
_ULONG = 2**64
_MAX_RANGE = 64 * 1024       # hosts in one lo-hi range (Slurm's MAX_RANGE)
_MAX_RANGES = 64 * 1024      # comma-separated items in one bracket (22.05: fatal() beyond)
_MAX_PREFIX_CNT = 64 * 1024  # hosts in one bracket group before the last (MAX_PREFIX_CNT)
_MAX_HOSTS = 1 << 20         # ours: no cluster has a million nodes; stops a[1-9999]b[1-9999]

_Range = tuple[int, int, int]  # lo, hi, zero-padded width


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm hostlist ("n[01-03,7],gpu[1-2]-ib") as `scontrol show hostnames` does."""
    if _CONTROL.search(text):
        raise ValueError(f"hostlist {text!r} contains a control character")
    hosts: list[str] = []
    try:
        for token in _tokens(text):
            if "[" in token or "]" in token or len(token) >= 20:
                hosts.extend(_expand_token(token, _MAX_HOSTS - len(hosts)))
            else:  # a plain name, too short for its number to overflow: as is (the fast path)
                hosts.append(token)
    except ValueError as e:
        raise ValueError(f"invalid hostlist {text!r}: {e}") from None
    if len(hosts) > _MAX_HOSTS:
        raise ValueError(f"hostlist {text[:80]!r}... names more than {_MAX_HOSTS} hosts")
    return hosts


def _tokens(text: str) -> list[str]:
    """Split at separators that are not inside brackets (Slurm's _next_tok)."""
    if "[" not in text:  # the common long case, "n1,n2,...": no bracket can join tokens
        return [token for token in _SEPARATOR.split(text) if token]
    return list(_bracketed_tokens(text))


def _bracketed_tokens(text: str) -> Iterator[str]:
    # Like _next_tok, brackets are searched for from `parse` to the end of the whole string;
    # `parse` only moves forward, so each search's answer is reused until passed (linear time).
    next_open, next_close = _forward_finder(text, "["), _forward_finder(text, "]")
    pos = 0
    while True:
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]  # "*" always matches
        if pos == len(text):
            return
        start = parse = pos
        end = _separator_at_or_after(text, pos)
        while True:
            open_at = next_open(parse)
            if open_at < 0 or open_at > end:
                break
            close_at = next_close(parse)
            if close_at < 0 or close_at < open_at:
                break
            if close_at < end:
                parse = close_at + 1
            else:  # a separator inside brackets: the token runs on past the ']'
                end = _separator_at_or_after(text, close_at)
        yield text[start:end]
        pos = end


def _forward_finder(text: str, char: str) -> Callable[[int], int]:
    found = -2  # not searched yet
    def find(start: int) -> int:
        nonlocal found
        if found == -2 or 0 <= found < start:
            found = text.find(char, start)
        return found
    return find


def _separator_at_or_after(text: str, pos: int) -> int:
    match = _SEPARATOR.search(text, pos)
    return match.start() if match else len(text)


def _expand_token(token: str, budget: int) -> list[str]:
    open_at = token.rfind("[")
    if open_at < 0:
        return [_bare_host(token)]
    close_at = token.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"{token!r} has a '[' without its ']'")
    # Slurm: text after the ']' is a suffix, unless it starts with ',' (then it is dropped).
    suffix = token[close_at + 1:]
    suffix = "" if suffix.startswith(",") else suffix
    last = _parse_range_list(token[open_at + 1:close_at])
    head, groups = _split_prefix(token[:open_at])
    for part in (head, suffix):
        if "[" in part or "]" in part:
            raise ValueError(f"{token!r} would give host names containing brackets")
    count = _count(last)
    for ranges, _ in groups:
        count *= _count(ranges)
    if count > budget:
        raise ValueError(f"more than {_MAX_HOSTS} hosts")
    return _combine(head, groups, _numbers(last), suffix)


def _bare_host(token: str) -> str:
    if "]" in token:
        raise ValueError(f"{token!r} has a ']' without its '['")
    digits = len(token) - len(token.rstrip("0123456789"))
    if digits >= 20 and int(token[-digits:]) >= _ULONG:  # Slurm would print a clamped number
        raise ValueError(f"{token!r}: its number does not fit in 64 bits")
    return token


def _split_prefix(prefix: str) -> tuple[str, list[tuple[list[_Range], str]]]:
    """Bracket groups before the last bracket, rightmost first, each with the text after it.

    Slurm's _push_range_list recursion: the last '[' and the last ']' after it delimit a group.
    """
    groups = []
    while (open_at := prefix.rfind("[")) >= 0 and (close_at := prefix.rfind("]", open_at)) >= 0:
        ranges = _parse_range_list(prefix[open_at + 1:close_at])
        if _count(ranges) > _MAX_PREFIX_CNT:
            raise ValueError(f"more than {_MAX_PREFIX_CNT} hosts in [{prefix[open_at + 1:close_at]}]")
        groups.append((ranges, prefix[close_at + 1:]))
        prefix = prefix[:open_at]
    return prefix, groups


def _combine(head: str, groups: list[tuple[list[_Range], str]], last: list[str],
             suffix: str) -> list[str]:
    # Slurm loops over the rightmost group outermost, then leftwards; the last bracket is
    # innermost. product() varies its first argument slowest, so pass groups as parsed.
    if not groups:
        return [head + num + suffix for num in last]
    tails = [tail for _, tail in reversed(groups)]
    hosts = []
    for picked in itertools.product(*(_numbers(ranges) for ranges, _ in groups)):
        stem = head + "".join(num + tail for num, tail in zip(reversed(picked), tails))
        hosts.extend([stem + num + suffix for num in last])
    return hosts


def _count(ranges: list[_Range]) -> int:
    return sum(hi - lo + 1 for lo, hi, _ in ranges)


def _numbers(ranges: list[_Range]) -> list[str]:
    numbers: list[str] = []
    for lo, hi, width in ranges:
        if lo == hi:  # fragmented allocations, "n[1,4,9,...]", are mostly single numbers
            numbers.append(str(lo).zfill(width))
        elif width <= len(str(lo)):  # no number in the range needs padding: plain str() is 3x faster
            numbers.extend(map(str, range(lo, hi + 1)))
        else:
            numbers.extend([str(n).zfill(width) for n in range(lo, hi + 1)])
    return numbers


def _parse_range_list(text: str) -> list[_Range]:
    items = text.split(",")
    if len(items) > _MAX_RANGES:
        raise ValueError(f"more than {_MAX_RANGES} items in one bracket")
    if _PLAIN_LIST.fullmatch(text):  # what Slurm itself writes; the general path is 5x slower
        return [_plain_range(item) for item in items]
    return [_parse_range(item) for item in items]


def _plain_range(item: str) -> _Range:
    low, _, high = item.partition("-")
    return _checked_range(item, int(low), int(high or low), len(low))


def _parse_range(item: str) -> _Range:
    """"lo" or "lo-hi" (Slurm's _parse_single_range, strtoul quirks included)."""
    bad = ValueError(f"invalid range {item!r}")
    dash = item.find("-")
    low, high = (item, "") if dash < 0 else (item[:dash], item[dash + 1:])
    if "x" in item or high.startswith("-"):  # 'x' is a multi-dimensional box, never ours
        raise bad
    lo, lo_end = _strtoul(low, bad)
    if high:  # as in C, junk after the low bound goes unnoticed once a high bound is parsed
        hi, hi_end = _strtoul(high, bad)
        if hi_end != len(high):
            raise bad
    elif lo_end != len(low):
        raise bad
    else:
        hi = lo
    return _checked_range(item, lo, hi, len(low.encode()))  # width is strlen(): bytes


def _checked_range(item: str, lo: int, hi: int, width: int) -> _Range:
    if lo > hi:
        raise ValueError(f"descending range {item!r}")
    if hi - lo + 1 > _MAX_RANGE:
        raise ValueError(f"more than {_MAX_RANGE} hosts in range {item!r}")
    if hi >= _ULONG - 1:  # Slurm's empty-range sentinel: it prints nothing or loops
        raise ValueError(f"range {item!r} does not fit in 64 bits")
    return lo, hi, width


def _strtoul(text: str, bad: ValueError) -> tuple[int, int]:
    """C strtoul(text, &end, 10): (value, end); `bad` when no digits were read."""
    match = _STRTOUL.match(text)
    if not match:
        raise bad
    value = int(match[2])
    if value >= _ULONG:
        raise ValueError(f"{text!r} does not fit in 64 bits")
    return (-value % _ULONG if match[1] == "-" else value), match.end()
