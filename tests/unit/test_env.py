"""meshrun.launcher.rank.env on recorded environments: every source, ports, user values, and Slurm hostlists.

Hostlist expectations marked (scontrol) are what slurm-wlm 22.05's `scontrol show hostnames`
printed; tests/integration/test_hostlist_scontrol.py checks many more against the real binary.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshrun.launcher.rank.env import (
    PORT_HIGH,
    PORT_LOW,
    RankEnv,
    expand_hostlist,
    master_port,
    rank_env,
    setdefault_env,
    torchrun_vars,
)

# Rank 5 of `srun -N2 --ntasks-per-node=4` in job 4242 (a requeued job: restart 2), as
# printed by `srun env` on node gpu08; unrelated variables trimmed.
SLURM_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_JOB_NAME": "meshrun",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_GTIDS": "4,5,6,7",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_SUBMIT_DIR": "/home/u/run",
}

# Task 1 of a 2-task submitit LocalExecutor job (controller pid 31337).
LOCAL_TASK = {
    "SUBMITIT_EXECUTOR": "local",
    "SUBMITIT_LOCAL_NTASKS": "2",
    "SUBMITIT_LOCAL_NODEID": "0",
    "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
    "SUBMITIT_LOCAL_LOCALID": "1",
    "SUBMITIT_LOCAL_GLOBALID": "1",
    "SUBMITIT_LOCAL_JOB_ID": "31337",
    "SUBMITIT_LOCAL_TIMEOUT_S": "300",
    "SUBMITIT_STDERR_TO_STDOUT": "",
    "CUDA_VISIBLE_DEVICES": "",
}

# Worker 3 of `torchrun --nnodes 2 --nproc-per-node 2 --rdzv-endpoint head:29400` on node 1.
TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "3",
    "ROLE_NAME": "default",
    "ROLE_WORLD_SIZE": "4",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "45123",
    "TORCHELASTIC_RESTART_COUNT": "1",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_RUN_ID": "exp7",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def with_(base: dict[str, str], **changes: str | None) -> dict[str, str]:
    """`base` with keys changed (None removes the key)."""
    env = {**base, **{k: v for k, v in changes.items() if v is not None}}
    return {k: v for k, v in env.items() if changes.get(k, "") is not None}


# ---- sources --------------------------------------------------------------------------------


def _rank(source: str, **facts: object) -> RankEnv:
    """What a rank of SOURCE knows: facts given, the rest those of rank 0 of a one-process world."""
    single = dict(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1)
    fields = {**single, "master_addr": "127.0.0.1", "job_id": "", "restart_count": 0, "hosts": ("127.0.0.1",)}
    start = int(str(facts.get("restart_count", 0))) * 1009  # each start its own port (start_index)
    port = master_port(str(facts.get("job_id", "")), start)
    return RankEnv(**{**fields, "master_port": port, **facts, "source": source})


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            SLURM_STEP,
            _rank(
                "slurm",
                rank=5,
                local_rank=1,
                world_size=8,
                local_world_size=4,
                node_rank=1,
                num_nodes=2,
                master_addr="gpu07",
                job_id="4242",
                restart_count=2,
                hosts=("gpu07", "gpu08"),
            ),
        ),
        (
            LOCAL_TASK,
            _rank("local", rank=1, local_rank=1, world_size=2, local_world_size=2, job_id="31337"),
        ),
        (
            TORCHRUN,
            _rank(
                "torchrun",
                rank=3,
                local_rank=1,
                world_size=4,
                local_world_size=2,
                node_rank=1,
                num_nodes=2,
                master_addr="head",
                master_port=45123,
                job_id="exp7",
                restart_count=1,
                hosts=(),
            ),
        ),
        ({}, _rank("single")),
    ],
    ids=["slurm", "local", "torchrun", "single"],
)
def test_each_source_gives_the_whole_rank(env: dict[str, str], expected: RankEnv) -> None:
    # Recorded environments of each source, read field by field (job id 4242's port: master_port("4242", start)).
    assert rank_env(env) == expected


def test_slurm_uneven_tasks_per_node() -> None:
    env = with_(
        SLURM_STEP,
        SLURM_STEP_NODELIST="n[1-3]",
        SLURM_STEP_NUM_NODES="3",
        SLURM_STEP_NUM_TASKS="7",
        SLURM_STEP_TASKS_PER_NODE="3,2(x2)",
        SLURM_PROCID="6",
        SLURM_NODEID="2",
        SLURM_LOCALID="1",
        SLURMD_NODENAME="n3",
    )
    r = rank_env(env)
    assert (r.world_size, r.num_nodes, r.node_rank, r.local_world_size) == (7, 3, 2, 2)
    assert r.hosts == ("n1", "n2", "n3") and r.master_addr == "n1"


def test_slurm_step_narrower_than_the_job_wins() -> None:
    # `srun -N1 -n2` inside the 2-node allocation: the step's variables describe the world.
    env = with_(
        SLURM_STEP,
        SLURM_STEP_NODELIST="gpu08",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_NTASKS="2",
        SLURM_NNODES="1",
        SLURM_NODELIST="gpu08",
        SLURM_TASKS_PER_NODE="2",
        SLURM_PROCID="1",
        SLURM_NODEID="0",
        SLURM_LOCALID="1",
    )
    r = rank_env(env)
    assert (r.world_size, r.num_nodes, r.local_world_size, r.master_addr) == (2, 1, 2, "gpu08")


@pytest.mark.parametrize("per_node", ["SLURM_NTASKS_PER_NODE", None])
def test_slurm_without_step_variables(per_node: str | None) -> None:
    # Older srun / hand-made environments: only job-level names, per-node counts from
    # --ntasks-per-node or an even split.
    env = {k: v for k, v in SLURM_STEP.items() if "STEP" not in k and "TASKS_PER_NODE" not in k}
    if per_node:
        env[per_node] = "4"
    r = rank_env(env)
    assert (r.rank, r.world_size, r.local_world_size, r.num_nodes) == (5, 8, 4, 2)


def test_slurm_user_master_addr_and_port_are_kept() -> None:
    r = rank_env(with_(SLURM_STEP, MASTER_ADDR="10.0.0.7", MASTER_PORT="23456"))
    assert (r.master_addr, r.master_port, r.source) == ("10.0.0.7", 23456, "slurm")


def test_local_executor_inside_an_interactive_slurm_shell_is_local() -> None:
    # `srun --pty bash` exports SLURM_PROCID=0 etc.; the LocalExecutor's tasks inherit them.
    shell = with_(
        SLURM_STEP,
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NODELIST="gpu07",
        SLURM_STEP_TASKS_PER_NODE="1",
    )
    r = rank_env({**shell, **LOCAL_TASK})
    assert (r.source, r.rank, r.world_size) == ("local", 1, 2)


def test_torchrun_inside_a_slurm_step_wins_and_keeps_slurm_job_facts() -> None:
    r = rank_env({**SLURM_STEP, **TORCHRUN})
    assert (r.source, r.rank, r.world_size, r.master_addr) == ("torchrun", 3, 4, "head")
    assert (r.job_id, r.restart_count, r.hosts) == ("4242", 2, ("gpu07", "gpu08"))


@pytest.mark.parametrize(
    "base, exported, expected",
    [
        # `srun bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS MASTER_ADDR=... python ...'`
        (SLURM_STEP, {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu07"}, (1, 4, 1, 2)),
        (LOCAL_TASK, {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, (1, 2, 0, 1)),
        # The scheduler counts other ranks (torchrun under srun -n1): it fills nothing.
        (
            with_(SLURM_STEP, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"),
            {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "gpu07"},
            (0, 1, 3, 4),
        ),
    ],
)
def test_hand_exported_torchrun_variables_take_the_rest_from_the_scheduler(
    base: dict[str, str], exported: dict[str, str], expected: tuple[int, int, int, int]
) -> None:
    r = rank_env({**base, **exported})
    assert r.source == "torchrun"
    assert (r.local_rank, r.local_world_size, r.node_rank, r.num_nodes) == expected


def test_torchrun_minimal_user_set() -> None:
    r = rank_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "box"})
    assert (r.local_rank, r.local_world_size, r.node_rank, r.num_nodes) == (0, 1, 2, 3)
    assert (r.master_port, r.job_id, r.hosts) == (master_port(""), "", ())


def test_single_process_takes_a_user_master_addr() -> None:
    r = rank_env({"MASTER_ADDR": "10.1.1.1", "PATH": "/usr/bin"})
    assert (r.source, r.master_addr, r.hosts) == ("single", "10.1.1.1", ("10.1.1.1",))


@pytest.mark.parametrize("env", [SLURM_STEP, LOCAL_TASK, TORCHRUN, {}], ids=["slurm", "local", "torchrun", "single"])
def test_exported_variables_read_back_the_same(env: dict[str, str]) -> None:
    # A rank's children (and a second rank_env in the same process) see the torchrun variables
    # it exported: they must describe the same rank.
    first = rank_env(env)
    exported = dict(env)
    setdefault_env(torchrun_vars(first), exported)
    again = rank_env(exported)
    assert again.source == "torchrun"
    skip = {"source", "hosts"}
    assert {f: v for f, v in dataclasses.asdict(again).items() if f not in skip} == {
        f: v for f, v in dataclasses.asdict(first).items() if f not in skip
    }


# ---- inconsistent environments: the message names the variable and its value ----------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 must be below SLURM_STEP_NUM_TASKS=8"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 must be below SLURM_STEP_NUM_NODES=2"),
        ({"SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 must be below the tasks on node 1=4"),
        ({"SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS=0: must be at least 1"),
        ({"SLURM_PROCID": "five"}, "SLURM_PROCID='five' is not a non-negative integer"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1'"),
        (
            {"SLURM_STEP_NODELIST": "gpu[07-09]"},
            "SLURM_STEP_NODELIST='gpu[07-09]' names 3 host(s) but SLURM_STEP_NUM_NODES=2",
        ),
        ({"SLURM_STEP_NODELIST": "gpu[08-07]"}, "SLURM_STEP_NODELIST: invalid hostlist 'gpu[08-07]'"),
        ({"SLURM_STEP_NODELIST": ","}, "SLURM_STEP_NODELIST=',' names no host"),
        ({"SLURMD_NODENAME": "gpu99"}, "SLURMD_NODENAME='gpu99' is not in SLURM_STEP_NODELIST"),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "4(x3)"},
            "SLURM_STEP_TASKS_PER_NODE='4(x3)' does not describe 8 tasks on 2 nodes",
        ),
        ({"SLURM_STEP_TASKS_PER_NODE": "4x2"}, "SLURM_STEP_TASKS_PER_NODE='4x2': '4x2' is not N or N(xM)"),
        (
            {"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": None, "SLURM_NPROCS": None},
            "none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS is",
        ),
        ({"SLURM_JOB_ID": None, "SLURM_JOBID": None}, "none of SLURM_JOB_ID, SLURM_JOBID is"),
        ({"SLURM_RESTART_COUNT": "x"}, "SLURM_RESTART_COUNT='x'"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT='0' is not a TCP port"),
        ({"MASTER_PORT": "65536"}, "MASTER_PORT='65536' is not a TCP port"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a non-negative integer"),
        ({"MASTER_ADDR": ""}, "MASTER_ADDR is set but empty"),
        ({"RANK": "3"}, "RANK='3' is set, but the slurm environment says RANK=5"),
        ({"LOCAL_RANK": "0"}, "LOCAL_RANK='0' is set, but the slurm environment says LOCAL_RANK=1"),
    ],
)
def test_inconsistent_slurm_environment(changes: dict[str, str | None], message: str) -> None:
    with pytest.raises(ValueError) as info:
        rank_env(with_(SLURM_STEP, **changes))
    assert message in str(info.value)


def test_slurm_uneven_without_per_node_counts() -> None:
    env = {k: v for k, v in SLURM_STEP.items() if "TASKS_PER_NODE" not in k}
    with pytest.raises(ValueError, match="7 tasks do not split evenly over 2 nodes"):
        rank_env(with_(env, SLURM_STEP_NUM_TASKS="7", SLURM_PROCID="1"))


def test_agreeing_torchrun_variable_is_fine() -> None:
    assert rank_env(with_(SLURM_STEP, RANK="5", LOCAL_RANK="1")).source == "slurm"


@pytest.mark.parametrize(
    "env, message",
    [
        (
            with_(LOCAL_TASK, SUBMITIT_LOCAL_GLOBALID="2"),
            "SUBMITIT_LOCAL_GLOBALID=2 must be below SUBMITIT_LOCAL_NTASKS=2",
        ),
        (with_(LOCAL_TASK, SUBMITIT_LOCAL_JOB_NUM_NODES="2"), "SUBMITIT_LOCAL_JOB_NUM_NODES=2"),
        (with_(LOCAL_TASK, WORLD_SIZE="8"), "WORLD_SIZE='8' is set, but the local environment says WORLD_SIZE=2"),
        (with_(TORCHRUN, RANK="4"), "RANK=4 must be below WORLD_SIZE=4"),
        (with_(TORCHRUN, LOCAL_WORLD_SIZE=None), "LOCAL_RANK=1 is set but LOCAL_WORLD_SIZE is not"),
        (
            with_(TORCHRUN, GROUP_WORLD_SIZE=None, WORLD_SIZE="5"),
            "WORLD_SIZE=5 is not a multiple of LOCAL_WORLD_SIZE=2",
        ),
        (with_(TORCHRUN, GROUP_RANK="2"), "GROUP_RANK=2 must be below GROUP_WORLD_SIZE=2"),
        (with_(TORCHRUN, MASTER_ADDR=""), "MASTER_ADDR is set but empty"),
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE='4' is set, but the single environment says WORLD_SIZE=1"),
    ],
)
def test_inconsistent_other_sources(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        rank_env(env)
    assert message in str(info.value)


# ---- torchrun_vars, setdefault_env ----------------------------------------------------------


def test_torchrun_vars() -> None:
    assert torchrun_vars(rank_env(SLURM_STEP)) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "5",
        "ROLE_WORLD_SIZE": "8",
        "NODE_RANK": "1",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": str(master_port("4242", 2 * 1009)),  # the recorded rank's restart 2
    }


def test_setdefault_env_sets_only_what_the_user_has_not() -> None:
    environ = {"MASTER_PORT": "23456", "NCCL_DEBUG": ""}
    updates = {"MASTER_PORT": "20001", "MASTER_ADDR": "gpu07", "NCCL_DEBUG": "WARN"}
    assert setdefault_env(updates, environ) == {"MASTER_ADDR": "gpu07"}
    assert environ == {"MASTER_PORT": "23456", "NCCL_DEBUG": "", "MASTER_ADDR": "gpu07"}
    assert updates["MASTER_PORT"] == "20001"  # the argument is left alone
    assert setdefault_env(updates, environ) == {}


# ---- master_port ----------------------------------------------------------------------------


def test_master_port_is_stable() -> None:
    # Pinned values: every rank (each its own process, str hashes salted) must compute the same.
    assert [master_port(j) for j in ("4242", "abc", "12345_7", "")] == [24242, 26612, 24584, 31981]


def test_master_port_range() -> None:
    ids = [str(i) for i in range(0, 200_000, 7)] + [f"job-{i}" for i in range(5000)]
    ports = {master_port(j) for j in ids}
    assert min(ports) >= PORT_LOW and max(ports) <= PORT_HIGH
    assert PORT_HIGH < 32768  # Linux's default ephemeral range starts there
    assert 29500 not in ports  # torchrun's default


def test_each_start_of_a_job_rendezvous_on_a_port_of_its_own() -> None:
    """A new user's trial: a requeued start stalled 42 s in rendezvous on the port its dying predecessor held."""
    from meshrun.launcher.rank.env import start_index

    starts = [{"SLURM_RESTART_COUNT": str(r), "MESHRUN_RESTART_IN_JOB": str(i)} for r in range(20) for i in range(5)]
    assert len({start_index(env) for env in starts}) == len(starts)
    assert len({master_port("4242", start_index(env)) for env in starts}) == len(starts)
    assert start_index({}) == 0 and master_port("4242", 0) == master_port("4242")
    env = with_(SLURM_STEP, SLURM_RESTART_COUNT="3")
    assert rank_env(env).master_port == master_port("4242", 3 * 1009) != rank_env(SLURM_STEP).master_port


def test_master_port_differs_between_jobs() -> None:
    # Consecutive ids, the jobs most likely to share a node, never collide within a window.
    window = PORT_HIGH - PORT_LOW
    assert len({master_port(str(i)) for i in range(10_000, 10_000 + window)}) == window
    assert master_port("4242") != master_port("4243")
    assert len({master_port(f"{i}_1") for i in range(50)}) == 50


# ---- expand_hostlist ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[01-10]", [f"n{i:02d}" for i in range(1, 11)]),
        ("n[009-011]", ["n009", "n010", "n011"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[5]", ["n5"]),
        ("n[0-0]", ["n0"]),
        ("n[00]", ["n00"]),
        ("n[1,3-5,7]", ["n1", "n3", "n4", "n5", "n7"]),
        ("n[3,1,3]", ["n3", "n1", "n3"]),  # order and duplicates kept
        ("n1,n1", ["n1", "n1"]),
        ("n[1,01,001]", ["n1", "n01", "n001"]),
        ("n[1-010]", [f"n{i}" for i in range(1, 11)]),  # width from the low bound (scontrol)
        ("n[01-3,7]", ["n01", "n02", "n03", "n7"]),
        ("n[1-]", ["n1"]),  # (scontrol)
        ("n[ 1-3]", ["n01", "n02", "n03"]),  # strtoul skips the space; strlen counts it
        ("n[+1-3]", ["n01", "n02", "n03"]),
        ("n[1 -3]", ["n01", "n02", "n03"]),
        ("n[1a-3]", ["n01", "n02", "n03"]),  # junk before '-' goes unnoticed (scontrol)
        ("a[01-03]b[1-2]", ["a01b1", "a01b2", "a02b1", "a02b2", "a03b1", "a03b2"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        (
            "a[1-2]b[3-4]c[5-6]",
            ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"],
        ),  # right-to-left nesting
        ("n[1-3][4-5]", ["n14", "n15", "n24", "n25", "n34", "n35"]),
        ("n[1-2]-[4-5]", ["n1-4", "n1-5", "n2-4", "n2-5"]),
        ("rack[1-2]_node[1,3]", ["rack1_node1", "rack1_node3", "rack2_node1", "rack2_node3"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # Slurm >= 23.11 (22.05 refuses)
        ("gpu[1-2].cluster.org", ["gpu1.cluster.org", "gpu2.cluster.org"]),
        ("a[1-2]b[3]c", ["a1b3c", "a2b3c"]),
        ("[1-3]", ["1", "2", "3"]),
        ("n[1-3],x", ["n1", "n2", "n3", "x"]),
        ("a,b,,c", ["a", "b", "c"]),
        (" n1  ,, n2 ", ["n1", "n2"]),
        ("a\tb c\nd", ["a", "b", "c", "d"]),
        ("x[1-2] y[3]", ["x1", "x2", "y3"]),
        ("a[1],b", ["a1", "b"]),
        ("c427-032,c429-002,c457-[011-012]", ["c427-032", "c429-002", "c457-011", "c457-012"]),
        ("é[1-2]", ["é1", "é2"]),
        ("n[1é-3]", ["n001", "n002", "n003"]),  # width counts bytes, as strlen does
        ("n18446744073709551614", ["n18446744073709551614"]),
        ("", []),
        (",", []),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, message",
    [
        ("n[3-1]", "descending range '3-1'"),
        ("n[010-1]", "descending range"),
        ("n[1-3", "has a '[' without its ']'"),
        ("[1-3", "has a '[' without its ']'"),
        ("n[1-2],m[1-3", "'m[1-3' has a '[' without its ']'"),
        ("n1-3]", "has a ']' without its '['"),
        ("n[[1-2]]", "containing brackets"),
        ("n[1-2]]", "containing brackets"),
        ("n[1-2]x]", "containing brackets"),
        ("x[y[1-2]z[3]", "containing brackets"),
        ("n[1-2]][3]", "invalid range '1-2]'"),
        ("n[]", "invalid range ''"),
        ("n[,]", "invalid range ''"),
        ("n[1,]", "invalid range ''"),
        ("n[-]", "invalid range '-'"),
        ("n[-1]", "invalid range '-1'"),
        ("n[1--3]", "invalid range '1--3'"),
        ("n[1-3-5]", "invalid range '1-3-5'"),
        ("n[a-c]", "invalid range 'a-c'"),
        ("n[1x]", "invalid range '1x'"),
        ("n[0x1]", "invalid range '0x1'"),
        ("n[1-3 ]", "invalid range '1-3 '"),
        ("a[x]b[1-2]c[3]", "invalid range 'x'"),  # Slurm logs it and drops these hosts silently
        ("n[1-65537]", "more than 65536 hosts in range '1-65537'"),
        ("a[1-65536,1]b[1]", "more than 65536 hosts in [1-65536,1]"),
        ("a[1-1024]b[1-1025]", "more than 1048576 hosts"),
        ("n[" + ",".join(["1"] * 65537) + "]", "more than 65536 items in one bracket"),
        ("n99999999999999999999999", "does not fit in 64 bits"),
        ("n[99999999999999999999]", "does not fit in 64 bits"),
        ("n[18446744073709551614-18446744073709551615]", "does not fit in 64 bits"),
        ("n\x01", "control character"),
        ("n1\r", "control character"),
    ],
)
def test_expand_hostlist_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        expand_hostlist(text)
    assert message in str(info.value)
    assert "hostlist" in str(info.value)


def test_expand_hostlist_limits_that_pass() -> None:
    assert len(expand_hostlist("n[1-65536]")) == 65536
    assert len(expand_hostlist("a[1-65536]b[1]")) == 65536
    assert len(expand_hostlist("n[" + ",".join(["7"] * 65536) + "]")) == 65536


@pytest.mark.parametrize(
    "text",
    [
        ",".join(f"node{i:05d}" for i in range(10_000)),  # uncompressed
        "gpu[00001-10000]",  # one range
        "n[" + ",".join(str(i) for i in range(0, 20_000, 2)) + "]",  # fragmented allocation
        ",".join(f"r{i:03d}n[01-10]" for i in range(1000)),  # 1000 racks
    ],
    ids=["plain", "range", "fragmented", "racks"],
)
def test_expand_hostlist_10k_hosts(text: str) -> None:
    # Speed is measured in bench/plan_scale.py, not here.
    hosts = expand_hostlist(text)
    assert len(hosts) == len(set(hosts)) == 10_000
