"""Where this rank computes: the checks that must pass before any collective, the device, the process group.

Every check here fails with one line naming the key, the value and the fix (a
SchemaError: `python -m meshrun.launcher` prints it and exits 2) instead of letting the
ranks hang in a rendezvous or NCCL init that can never complete.
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist

from meshrun.launcher.contract.exitcodes import EXIT_NO_PROGRESS
from meshrun.launcher.contract.records.rundir import record_exit
from meshrun.launcher.contract.spec.job import JobSpec
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.rank.env import RankEnv
from meshrun.launcher.rank.failure import record_rank_error
from meshrun.launcher.sidecar.rendezvous import rank_span

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
GPU_PROCESS_GROUP = "cpu:gloo,cuda:nccl"
"""NCCL for the GPUs' collectives, and gloo beside it for CPU tensors: the asynchronous checkpoint
(torch.distributed.checkpoint.async_save) coordinates its background write over a CPU backend and refuses a
NCCL-only group (found on an H200: every GPU job died at its first checkpoint)."""
INIT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long ranks wait for each other in collectives (and NCCL's init) before failing loudly; the rendezvous
itself, the store and every rank's arrival, has its own bound (watchdog.rendezvous_timeout_s)."""
JOINED_KEY = "meshrun/joined/"
"""Each rank sets JOINED_KEY + its rank in the store once connected: who is missing, when the wait runs out."""


class RendezvousTimeout(Exception):
    """The rendezvous did not complete in time; the message names the ranks and nodes that did not join."""


@dataclass(frozen=True)
class Runtime:
    """Where and how this rank computes."""

    device: torch.device
    backend: str
    amp_dtype: Optional[torch.dtype]
    """bf16/fp16 for mixed precision on GPUs; None: plain fp32 (always on CPU)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.amp_dtype, "fp32")  # type: ignore[arg-type]


def check_tasks(job: JobSpec, env: RankEnv) -> None:
    """The ranks that started must be the ones the spec asked for (else a collective waits forever)."""
    if env.world_size != job.world_size:
        raise SchemaError(
            "resources",
            env.world_size,
            f"{env.world_size} rank(s) started but the spec asks for nodes({job.resources.nodes}) x "
            f"tasks per node({job.tasks_per_node}) = {job.world_size}; start the job with "
            f"`meshrun submit` or make srun's task count match",
        )
    if env.local_world_size != job.tasks_per_node:
        raise SchemaError(
            "resources.tasks_per_node",
            job.tasks_per_node,
            f"node {env.node_rank} runs {env.local_world_size} rank(s), not {job.tasks_per_node}; "
            f"start the same number of tasks on every node (srun --ntasks-per-node)",
        )


def visible_gpus(environ: Mapping[str, str]) -> Optional[tuple[str, ...]]:
    """CUDA_VISIBLE_DEVICES as a tuple of entries (indexes or UUIDs); None when it is unset."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return tuple(item.strip() for item in value.split(",") if item.strip())


def gpu_index(env: RankEnv, gpus_per_node: int, device_count: int, visible: Optional[tuple[str, ...]]) -> int:
    """Which of the visible GPUs this rank uses: 0 when it sees only its own, else its local rank."""
    shown = "unset" if visible is None else ",".join(visible) or "''"
    if env.local_world_size > gpus_per_node:
        raise SchemaError(
            "resources.tasks_per_node",
            env.local_world_size,
            f"more ranks per node than resources.gpus_per_node({gpus_per_node}): ranks would share "
            "a GPU, which NCCL refuses; run one task per GPU (leave tasks_per_node unset)",
        )
    if device_count == 1:
        return 0  # Slurm's --gpus-per-task / a per-task cgroup: this rank's own GPU is index 0
    if device_count >= env.local_world_size:
        return env.local_rank  # the whole node is visible: local rank i uses GPU i
    raise SchemaError(
        "resources.gpus_per_node",
        gpus_per_node,
        f"rank {env.rank} sees {device_count} GPU(s) (CUDA_VISIBLE_DEVICES={shown}) but its node "
        f"runs {env.local_world_size} ranks; give each task one GPU or all of the node's "
        "(srun --gpus-per-task=1, or no per-task binding)",
    )


def pick_runtime(job: JobSpec, env: RankEnv, environ: Mapping[str, str]) -> Runtime:
    """NCCL on this rank's GPU when the job asked for GPUs and has them, else gloo on CPU (fp32 math).

    A job that asked for GPUs on a machine without CUDA (the Slurm testbed's fake GPUs)
    runs on the CPU, as announced by the trainer's first line.
    """
    if job.resources.gpus_per_node > 0 and torch.cuda.is_available():
        index = gpu_index(env, job.resources.gpus_per_node, torch.cuda.device_count(), visible_gpus(environ))
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # before init: NCCL binds each rank's communicator to its GPU
        return Runtime(device, "nccl", AMP_DTYPES.get(job.trainer.precision))
    return Runtime(torch.device("cpu"), "gloo", None)


def process_group_backend(runtime: Runtime) -> str:
    """What init_process_group is given: on GPUs NCCL with gloo beside it (GPU_PROCESS_GROUP), on CPU gloo."""
    return GPU_PROCESS_GROUP if runtime.cuda else runtime.backend


def init_distributed(
    env: RankEnv,
    runtime: Runtime,
    bound_s: float = INIT_TIMEOUT.total_seconds(),
    on_joined: Callable[[], None] = lambda: None,
) -> None:
    """Join the process group from the RankEnv (not os.environ: one place reads the environment). The rendezvous
    (rank 0's store, every rank's arrival in it) waits at most `bound_s` and raises RendezvousTimeout naming who did
    not join; `on_joined` runs once every rank has arrived (the heartbeat leaves phase "rendezvous")."""
    device_id = runtime.device if runtime.cuda else None
    backend = process_group_backend(runtime)
    if env.world_size == 1:
        # No rendezvous needed: a private store cannot collide with a busy port.
        on_joined()
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
        return
    store = rendezvous(env, bound_s)
    on_joined()
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        device_id=device_id,
        timeout=INIT_TIMEOUT,
    )


def join_or_exit(
    env: RankEnv, runtime: Runtime, job: JobSpec, run_dir: str, on_joined: Callable[[], None]
) -> Optional[int]:
    """init_distributed within watchdog.rendezvous_timeout_s; None once joined, else the exit code after one line
    in this rank's log and in rank-error.txt (no torch traceback): EXIT_NO_PROGRESS, requeued as a hang is."""
    try:
        init_distributed(env, runtime, job.watchdog.rendezvous_timeout_s, on_joined)
    except RendezvousTimeout as exc:
        print(f"meshrun launcher: error: {exc}", file=sys.stderr, flush=True)
        record_rank_error(run_dir, env.rank, str(exc))
        try:  # any rank: rank 0 may be the one that never came
            record_exit(Path(run_dir), EXIT_NO_PROGRESS)
        except OSError:
            pass
        return EXIT_NO_PROGRESS
    return None


def rendezvous(env: RankEnv, bound_s: float) -> dist.TCPStore:
    """Rank 0's store, reached, and every rank arrived in it, within `bound_s` seconds (RendezvousTimeout if not).

    torch's own waits would take INIT_TIMEOUT and end in a traceback that names no one: a requeued start lost 42 s
    (and could have lost 20 minutes) in a store connect that could not complete."""
    deadline = time.monotonic() + bound_s
    try:
        store = rendezvous_store(env, datetime.timedelta(seconds=bound_s))
    except dist.DistError as exc:  # DistNetworkError: no store at MASTER_ADDR:MASTER_PORT in time
        raise RendezvousTimeout(
            f"rendezvous: rank {env.rank} could not reach rank 0's store at {env.master_addr}:{env.master_port} "
            f"within {bound_s:g} s (watchdog.rendezvous_timeout_s): {node_ranks(env, [0])} did not join ({exc})"
        ) from None
    store.set(f"{JOINED_KEY}{env.rank}", env.hosts[env.node_rank] if env.hosts else str(env.node_rank))
    keys = [f"{JOINED_KEY}{rank}" for rank in range(env.world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except dist.DistError:
        missing = [rank for rank in range(env.world_size) if not store.check([keys[rank]])]
        raise RendezvousTimeout(
            f"rendezvous: {node_ranks(env, missing)} did not join within {bound_s:g} s "
            f"(watchdog.rendezvous_timeout_s); the other {env.world_size - len(missing)} rank(s) waited"
        ) from None
    store.set_timeout(INIT_TIMEOUT)  # from here on the process group's own waits
    return store


def node_ranks(env: RankEnv, ranks: list[int]) -> str:
    """'node n3 (ranks 4-5)' for each node of `ranks` (Slurm's block distribution, as meshrun.launcher.rank.env assumes)."""
    per_node = max(env.local_world_size, 1)
    by_node: dict[int, list[int]] = {}
    for rank in sorted(ranks):
        by_node.setdefault(rank // per_node, []).append(rank)
    parts = []
    for index, members in by_node.items():
        node = env.hosts[index] if index < len(env.hosts) else f"index {index}"
        parts.append(f"node {node} ({rank_span(members)})")
    return ", ".join(parts) or "no rank"


def rendezvous_store(env: RankEnv, timeout: datetime.timedelta = INIT_TIMEOUT) -> dist.TCPStore:
    """The job's rendezvous store. Rank 0 serves it on the address the other ranks reach it at (MASTER_ADDR), not
    on every interface of its node as torch's own TCPStore does (its protocol has no authentication: any user of
    the node could connect); where that address cannot be bound here, torch's own listener serves, as before.
    Rank 0 does not wait in here for the others (rendezvous() does, naming who is missing)."""
    if env.rank != 0:
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    listener = _listener(env.master_addr, env.master_port)
    return dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        **({"master_listen_fd": listener} if listener is not None else {}),
    )


def _listener(addr: str, port: int) -> Optional[int]:
    """A listening socket on `addr`:`port` alone, its descriptor handed over to the store (None: not bindable
    here, said once in the rank's log)."""
    import socket

    try:
        family, kind, proto, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            raise
    except OSError as exc:
        print(
            f"[meshrun] rendezvous: cannot listen on {addr}:{port} alone ({exc}); torch's store listens on every "
            "interface of this node",
            flush=True,
        )
        return None
    return sock.detach()  # the store owns it now
