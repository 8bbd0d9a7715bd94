"""Seeded journeys of a user on a cluster (a `Site`: `local`, or the real Slurm testbed), and the invariants
every step must keep (the class of bug, not its instances).

A journey is a sequence of steps drawn by `random.Random(seed)`: submit beside running jobs (the same
code, or from one of two project folders, changed since its last submit), cancel, resume, kill -9 of one
process of a running job (local: a rank, the rank controller, the sidecar, the supervisor; Slurm: a rank,
a node's sidecar or its copier child, the batch shell), a `logs -f` client killed, a `meshrun tb` client
killed (then `tb --stop`), a preemption by a high-partition job (Slurm), a second Unix user trying to read a
job's files and its TensorBoard, the read verbs (status, logs, top, export), and a framework's job beside the
others (a plain Lightning script, examples/lightning_train.py: it reports no step, and stops on SIGTERM with an
exit 0 of its own).
Every job trains the same tiny model
with the same seed, so every loss any job logs for step N must equal, bit for bit, the loss an
uninterrupted run logged for step N (`reference`): a resume that is not exact shows up wherever it lands.

After every step `check` holds the journey to the invariants:
- every verb exits 0, 1, 2 or 130; an error is one line, never "internal error" or a traceback;
- a job seen ended keeps its state, step and checkpoint (each id its own; a resume beside it changes nothing);
- a checkpoint marked complete is complete (marker and DCP metadata), and the checkpoint a job reports
  is on disk, or a later job of its run dir went past it;
- no job reports success with lost steps: a COMPLETED job has no checkpoint_lost alert and exit code 0, and
  a framework's job that reports nothing was COMPLETED only once its program trained every epoch (its last line);
- nothing meshrun writes is readable by another user, under umask 000 as under 022 (mode bits after every
  step; a real second user's reads and HTTP requests in the steps that are about it);
- the code snapshot a running job runs from (Slurm) is there, unchanged, until it ends;
- no process outside the journey's jobs is signalled (a decoy started first is alive at the end);
- an ended job's goodput record adds up (its parts, none negative, sum to its allocated time).

The journey's log (`Journey.log`) is in every failure's message, with the seed that replays it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import psutil

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.records.rundir import RunDir
from meshrun.submit.views import tbserve
from tests.helpers import sshbed, tbhelp
from tests.helpers.cli import FINAL_STATES, REPO, SMALL_MODEL, TINY, TWO_NODES, env_for, meshrun, poll_pauses, submitted

STEPS = 60
EVERY = 5
SETTINGS = ["--set", f"train.steps={STEPS}", "--set", f"checkpoint.every={EVERY}"]
SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
"""sacct's words for a job that has ended (the preempting job's)."""
EXITS = {0, 1, 2, 130}
MAX_RUNNING = 2
"""Jobs running at once (two ranks each): more only slows a 2-core machine down."""


@dataclass(frozen=True)
class Site:
    """Where the journey's jobs run, and how their processes are told apart."""

    name: str
    job_env: str
    """The variable every process of a job carries, valued its job id."""
    roles: Mapping[str, str]
    """role -> a word of its command line (the first role whose word matches names the process)."""
    spec: tuple[str, ...]
    """The spec file and cluster, before the journey's settings."""
    high_partition: Optional[str] = None
    """A partition whose jobs preempt the journey's (Slurm): a `preempt` step is drawn only with one."""
    ships_code: bool = False
    """Jobs run from a code snapshot on the cluster (Slurm), not from the project folder in place (`local`)."""
    laptop: bool = False
    """meshrun runs as on a laptop: no Slurm here, the cluster reached over SSH (its profile in the journey's
    HOME); a `drop_ssh` step kills the server side of its SSH connections."""


# The local job: its supervisor, the rank controller (whose forked children are the ranks: same command
# line), the sidecar (and its keeper and copier).
LOCAL = Site(
    "local",
    "MESHRUN_JOB_ID",
    {
        "sidecar": "meshrun.launcher.sidecar",
        "supervisor": "meshrun.launcher.local.supervisor",
        "controller": "meshrun.launcher.local.controller",
    },
    tuple(TINY),
)
# The testbed's two-node job: the batch shell, each node's sidecar, the ranks (`python -m meshrun.launcher RUN_DIR`).
TESTBED = Site(
    "testbed",
    "SLURM_JOB_ID",
    # The copier (a sidecar's child copying one staged checkpoint) first: its command line names the sidecar too.
    {
        "copier": "meshrun.launcher.sidecar.copier",
        "sidecar": "meshrun.launcher.sidecar",
        "batch": "slurm_script",
        "rank": "-m meshrun.launcher /",
    },
    (*TWO_NODES, *SMALL_MODEL),
    high_partition="high",
    ships_code=True,
)
# The same cluster from a laptop: every verb over SSH to the testbed's sshd (tests/helpers/sshbed.py).
LAPTOP = dataclasses.replace(TESTBED, name="laptop", laptop=True)


def spec_args(site: Site, corpus: Path, spec_file: Optional[Path] = None) -> list[str]:
    """The journey's job: the site's spec (or its copy in a project folder), the shared corpus, STEPS long."""
    return [
        *([str(spec_file), *site.spec[1:]] if spec_file else site.spec),
        "--set",
        f"data.path={corpus}",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.log_every=1",
        *SETTINGS,
    ]


FRAMEWORK_EPOCHS = 100
"""The framework job's length: one step an epoch of 0.2 s, about 20 s of training beside the journey's jobs."""
FRAMEWORK_DONE = re.compile(r"^epoch (\d+) done$", re.M)
FRAMEWORK_FINAL = re.compile(r"^final loss [0-9.]+ after epoch (\d+) step \d+$", re.M)


def framework_args(site: Site) -> list[str]:
    """The journey's framework job: examples/lightning_train.py on the site's cluster (two nodes of one rank on
    Slurm, two ranks on `local`), no meshrun imports, nothing reported to meshrun."""
    cluster = site.spec[site.spec.index("-c") + 1]
    shape = "resources.nodes=2" if site.ships_code else "resources.tasks_per_node=2"
    command = f"command=python3,examples/lightning_train.py,--epochs,{FRAMEWORK_EPOCHS},--sleep,0.2"
    return ["examples/lightning.yaml", "-c", cluster, "--set", shape, "--set", command]


def framework_epochs(run_dir: Path, final: bool = False) -> int:
    """The newest epoch rank 0 of a framework job said it finished (`final`: its last line's, 0 without one)."""
    path = run_dir / "logs" / "rank-0.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    found = (FRAMEWORK_FINAL if final else FRAMEWORK_DONE).findall(text)
    return int(found[-1]) if found else 0


def checkpoint_root(run_dir: Path) -> Path:
    """Where the job's checkpoints are (spec.json's run.checkpoint_dir: a cluster's root, or in the run dir)."""
    try:
        run = json.loads((run_dir / "spec.json").read_text())["run"]
    except (OSError, ValueError, KeyError):
        return run_dir / "checkpoints"
    return Path(run.get("checkpoint_dir") or run_dir / "checkpoints")


def losses_by_step(run_dir: Path, job_id: Optional[str] = None) -> dict[int, float]:
    """The step lines of metrics.jsonl (of one job, or any), as step -> loss."""
    path = run_dir / "metrics.jsonl"
    found: dict[int, float] = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        if not line.endswith("}"):
            continue  # being written
        row = json.loads(line)
        if "step" in row and "loss" in row and "event" not in row and (job_id is None or row.get("job") == job_id):
            found[int(row["step"])] = float(row["loss"])
    return found


@dataclass
class Job:
    job_id: str
    run_dir: Path
    parent: Optional[str] = None
    ended: Optional[tuple[Any, ...]] = None
    """(state, step, checkpoint step, exit code) when first seen ended: what it must keep showing."""
    row: dict[str, Any] = field(default_factory=dict)
    code: Optional[dict[str, int]] = None
    """The files (path -> size) of the folder it runs from, when first seen running."""
    framework: bool = False
    """A framework's script (framework_args): no metrics; its rank-0 log says how far it got."""


class JourneyFailed(AssertionError):
    pass


@dataclass
class Journey:
    site: Site
    seed: int
    home: Path
    corpus: Path
    reference: dict[int, float]
    rng: random.Random = field(init=False)
    umask: int = field(init=False)
    jobs: dict[str, Job] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    decoy: Optional[subprocess.Popen[bytes]] = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.umask = self.rng.choice([0o022, 0o000])
        if self.site.laptop:  # the cluster is the profile that reaches the testbed over SSH
            profile = sshbed.profile(self.home, name="testbed-ssh")
            self.site = dataclasses.replace(self.site, spec=_on_cluster(self.site.spec, str(profile)))

    # --- running meshrun as the user, and the verbs' invariant ---------------------------------------------

    def verb(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        old = os.umask(self.umask)  # the user's umask reaches every process meshrun starts
        try:
            done = meshrun(self.home, *args, timeout=timeout, laptop=self.site.laptop)
        finally:
            os.umask(old)
        shown = " ".join(args).replace(" ".join(spec_args(self.site, self.corpus)), "SPEC")
        shown = shown.split(" -c ")[0] + " SPEC" if " code.root=" in shown else shown  # a project's spec copy
        self.log.append(f"meshrun {shown} -> {done.returncode}")
        said = done.stdout + done.stderr
        self.expect(done.returncode in EXITS, f"exit {done.returncode} outside {sorted(EXITS)}:\n{said}")
        self.expect("internal error" not in said and "Traceback" not in said, f"a traceback:\n{said}")
        if done.returncode not in (0, 130):
            lines = done.stderr.strip().splitlines()
            self.expect(len(lines) == 1, f"an error of {len(lines)} lines:\n{done.stderr}")
        return done

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            raise JourneyFailed(
                f"seed {self.seed} (umask {self.umask:03o}): {what}\njourney:\n  " + "\n  ".join(self.log)
            )

    # --- what the user sees ----------------------------------------------------------------------------------

    def rows(self) -> dict[str, dict[str, Any]]:
        if not self.jobs:
            return {}
        done = self.verb("status", *self.jobs, "--json")
        self.expect(done.returncode == 0, f"status failed: {done.stderr}")
        return {row["job_id"]: row for row in json.loads(done.stdout)}

    def running(self, rows: dict[str, dict[str, Any]]) -> list[Job]:
        return [self.jobs[j] for j, row in rows.items() if not row["done"]]

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = 120, final: bool = False) -> None:
        """Until `ready()`; `final`: what it waits for does not go away (a job's end), so it may poll slowly."""
        deadline = time.monotonic() + timeout
        pauses = poll_pauses(FINAL_STATES if final else ())
        while not ready():
            self.expect(time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s")
            time.sleep(next(pauses))

    def ended(self, job: Job) -> bool:
        return bool(self.rows()[job.job_id]["done"])  # meshrun's own word: `watch` and `--wait` stop on it

    # --- the steps ---------------------------------------------------------------------------------------------

    def step(self) -> None:
        rows = self.rows()
        running = self.running(rows)
        ended = [self.jobs[j] for j, row in rows.items() if row["done"]]
        choices: list[Callable[[], None]] = [self.read_verbs, self.pause]
        if len(running) < MAX_RUNNING:
            choices += [self.submit] * 2 + [self.submit_project, self.submit_framework]
        if self.jobs:
            choices += [self.tensorboard, self.peer_reads]
        if running:
            choices += [lambda: self.cancel(self.rng.choice(running))] * 2
            choices += [lambda: self.kill(self.rng.choice(running))] * 3
            choices += [lambda: self.follow_and_kill(self.rng.choice(running))]
        if running and self.site.high_partition:
            choices += [self.preempt] * 2
        if running and self.site.laptop:
            choices += [lambda: self.drop_ssh(self.rng.choice(running))] * 2
        resumable = [j for j in ended if rows[j.job_id]["state"] != "COMPLETED" and not self.resumed(j)]
        if resumable and len(running) < MAX_RUNNING:
            choices += [lambda: self.resume(self.rng.choice(resumable))] * 4
        self.rng.choice(choices)()

    def resumed(self, job: Job) -> bool:
        return any(other.parent == job.job_id for other in self.jobs.values())

    def submit(self) -> None:
        done = self.verb("submit", *spec_args(self.site, self.corpus))
        self.expect(done.returncode == 0, f"submit failed: {done.stderr}")
        job_id, run_dir = submitted(done)
        self.jobs[job_id] = Job(job_id, run_dir)
        self.log[-1] += f" {job_id}"

    def submit_framework(self) -> None:
        """A Lightning script's job beside the others: meshrun must tell its exit 0 on a stop (a preemption's
        SIGTERM, a cancel's) from a finish, though it reports no step."""
        done = self.verb("submit", *framework_args(self.site))
        self.expect(done.returncode == 0, f"submit of the framework job failed: {done.stderr}")
        job_id, run_dir = submitted(done)
        self.jobs[job_id] = Job(job_id, run_dir, framework=True)
        self.log[-1] = f"meshrun submit FRAMEWORK -> 0 {job_id}"

    def submit_project(self) -> None:
        """A submit from one of two project folders (the spec's copy in it, `code.root: .`), the second time
        after a file of it changed: on Slurm a new code snapshot beside the running jobs' own, which must
        keep theirs unchanged (`check_code`); on `local` the ranks run in the project folder itself."""
        project = self.home / "projects" / self.rng.choice(["alpha", "beta"])
        spec = project / Path(self.site.spec[0]).name
        if project.exists():
            with (project / "notes.py").open("a") as changed:
                changed.write(f"# changed before submit {len(self.jobs)}\n")
        else:
            project.mkdir(parents=True)
            spec.write_text((REPO / self.site.spec[0]).read_text())
            (project / "notes.py").write_text("# the project's own code\n")
        done = self.verb("submit", *spec_args(self.site, self.corpus, spec), "--set", "code.root=.")
        self.expect(done.returncode == 0, f"submit from {project.name} failed: {done.stderr}")
        job_id, run_dir = submitted(done)
        self.jobs[job_id] = Job(job_id, run_dir)
        self.log[-1] += f" {job_id} (project {project.name})"

    def tensorboard(self) -> None:
        """`meshrun tb JOB`: the owner's URL opens the board; the second Unix user, on the same loopback port,
        gets 403 and nothing of the run. Then the client is killed with -9 (its server is left running, as
        documented) and `meshrun tb --stop JOB` ends that server."""
        job = self.rng.choice(list(self.jobs.values()))
        proc = tbhelp.meshrun_tb(self.home, job.job_id)
        try:
            line = sshbed.first_line_with(proc.stdout, "http://127.0.0.1:", timeout=90)
            self.expect(line is not None, f"meshrun tb {job.job_id} printed no URL")
            url = (line or "").split()[-1]
            tbhelp.Browser(url)  # the owner's browser: the token URL sets its cookie (an HTTP error raises)
            base, _ = tbhelp.split_url(url)
            code, body = tbhelp.http_code_as_other(base + "data/runs")
            self.expect(code == 403 and job.job_id not in body, f"another user got HTTP {code} from {base}")
        finally:
            proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()
        self.log.append(f"meshrun tb {job.job_id}: another user refused; kill -9 of the client")
        left = tbhelp.servers(keys=[tbserve.state_dir([(job.job_id, job.run_dir)]).name], under=[self.home])
        done = self.verb("tb", "--stop", job.job_id)
        self.expect(done.returncode == 0, f"tb --stop: {done.stderr}")
        self.expect(
            all(tbhelp.gone(pid, started) for pid, started in left.items()), "a TensorBoard server outlived tb --stop"
        )

    def peer_reads(self) -> None:
        """The second Unix user tries to list and read a job's files: every attempt fails."""
        job = self.rng.choice(list(self.jobs.values()))
        root = checkpoint_root(job.run_dir)
        complete = ckptdir.complete_steps(root)
        targets = [
            job.run_dir / "metrics.jsonl",
            job.run_dir / "spec.json",
            job.run_dir / "logs" / "rank-0.log",
            *([ckptdir.step_dir(root, complete[-1]) / ".metadata"] if complete else []),
            self.home / "state" / "meshrun" / "registry.sqlite",
        ]
        self.log.append(f"another user reads {job.job_id}'s files")
        for path in targets:
            if path.exists():
                read = tbhelp.as_other("cat", str(path))
                self.expect(read.returncode != 0, f"another user read {path}")
        for folder in (job.run_dir, root):
            listed = tbhelp.as_other("ls", str(folder))
            self.expect(listed.returncode != 0, f"another user listed {folder}: {listed.stdout[:200]}")

    def cancel(self, job: Job) -> None:
        self.wait_a_few_steps(job)
        done = self.verb("cancel", job.job_id)
        self.expect(done.returncode in (0, 1), f"cancel: {done.stderr}")  # 1: it ended meanwhile, said so
        self.wait_until(f"{job.job_id} ends after its cancel", lambda: self.ended(job), final=True)

    def resume(self, job: Job) -> None:
        done = self.verb("resume", job.job_id)
        if done.returncode != 0:
            # Refused in one line (checked): only when there is nothing to resume from, or nothing left to train.
            complete = ckptdir.complete_steps(checkpoint_root(job.run_dir))
            self.expect(not complete or complete[-1] >= STEPS, f"resume refused: {done.stderr}")
            return
        child = done.stdout.split(" as job ")[1].split()[0]
        self.log[-1] += f" {child}"
        self.jobs[child] = Job(child, job.run_dir, parent=job.job_id, framework=job.framework)

    def kill(self, job: Job) -> None:
        self.wait_a_few_steps(job)
        role = self.rng.choice([*self.site.roles, "rank"] if "rank" not in self.site.roles else list(self.site.roles))
        victims = processes_of(self.site, job, role)
        deadline = time.monotonic() + 10
        while not victims and role == "copier" and time.monotonic() < deadline:  # it lives while a copy runs
            time.sleep(0.05)
            victims = processes_of(self.site, job, role)
        if not victims:
            self.log.append(f"kill -9 {role} of {job.job_id}: none running")
            return
        victim = self.rng.choice(victims)
        self.log.append(f"kill -9 {role} of {job.job_id} (pid {victim.pid})")
        try:
            victim.send_signal(signal.SIGKILL)  # psutil checks it is still that process (its start time)
        except psutil.NoSuchProcess:
            return
        if role == "supervisor":
            # Its ranks run on as orphans (README's flow): the user cancels them.
            self.wait_until(f"{job.job_id}'s supervisor gone", lambda: not victim.is_running())
            self.cancel(job)

    def preempt(self) -> None:
        """A job in the high partition that needs the nodes' CPUs: Slurm preempts the running jobs (their
        ranks save in the grace time, the batch script requeues them) and they resume when it is done."""
        from tests.testbed import testbed as tb

        for job in self.running(self.rows()):
            self.wait_a_few_steps(job)
        argv = [
            "sbatch",
            "--parsable",
            f"--partition={self.site.high_partition}",
            "--nodes=2",
            "--ntasks-per-node=1",
            f"--cpus-per-task={tb.CPUS_PER_NODE - 1}",
            f"--output={self.home}/preemptor-%j.out",
            "--wrap=sleep 3",
        ]
        high = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
        self.log.append(f"preempt: high job {high}")
        self.wait_until(f"the preempting job {high} ends", lambda: _sacct_state(high) in SLURM_ENDED, timeout=180)

    def follow_and_kill(self, job: Job) -> None:
        """A `logs -f` client killed with -9: nothing of the job may notice."""
        env = env_for(self.home, laptop=self.site.laptop)
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshrun.submit.cli.main", "logs", job.job_id, "-f"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(self.rng.uniform(0.5, 2.0))
        proc.kill()
        proc.wait()
        self.log.append(f"kill -9 `logs -f {job.job_id}`")

    def drop_ssh(self, job: Job) -> None:
        """kill -9 of the server side of every SSH connection (sshd's per-connection processes) while a
        `logs -f` follows a running job: the follower reconnects (or ends with the job), the next verb works."""
        follower = subprocess.Popen(
            [sys.executable, "-m", "meshrun.submit.cli.main", "logs", job.job_id, "-f"],
            cwd=REPO,
            env=env_for(self.home, laptop=True),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(self.rng.uniform(1.0, 3.0))
            dropped = sshbed.kill_sessions()
            self.log.append(f"kill -9 of {dropped} SSH connection(s) while `logs -f {job.job_id}` follows")
            time.sleep(3.0)
            if follower.poll() is None:
                follower.send_signal(signal.SIGINT)  # the user's Ctrl-C, once it has had time to reconnect
            _, err = follower.communicate(timeout=60)
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
        self.expect(
            follower.returncode in (0, 130), f"logs -f after a dropped connection: {follower.returncode}\n{err}"
        )
        self.expect("Traceback" not in err and "internal error" not in err, f"logs -f after a drop:\n{err}")

    def pause(self) -> None:
        seconds = self.rng.uniform(0.5, 4.0)
        self.log.append(f"pause {seconds:.1f} s")
        time.sleep(seconds)

    def read_verbs(self) -> None:
        job = self.rng.choice(list(self.jobs.values())) if self.jobs else None
        self.verb("status")
        self.verb("top", "--once")
        if job is None:
            return
        self.verb("status", job.job_id)
        self.verb("logs", job.job_id)
        out = self.home / f"export-{len(self.log)}"
        self.verb("export", job.job_id, "-o", str(out))

    def wait_a_few_steps(self, job: Job) -> None:
        """Until the job logged a step at random (or ended): the kill or cancel lands mid-training."""
        if job.framework:  # rank 0 says every 10th epoch (the first start's or a later one's)
            epoch = 10 * self.rng.randint(1, FRAMEWORK_EPOCHS // 20)
            self.wait_until(
                f"{job.job_id} reaches epoch {epoch}",
                lambda: framework_epochs(job.run_dir) >= epoch or self.ended(job),
                timeout=180,
            )
            return
        want = self.rng.randint(1, STEPS // 2)
        self.wait_until(
            f"{job.job_id} reaches step {want}",
            lambda: max(losses_by_step(job.run_dir, job.job_id), default=0) >= want or self.ended(job),
        )

    # --- the invariants --------------------------------------------------------------------------------------

    def check(self) -> None:
        rows = self.rows()
        for job_id, row in rows.items():
            job = self.jobs[job_id]
            job.row = row
            shown = (
                row["state"],
                row["progress"].get("step"),
                row["progress"].get("checkpoint_step"),
                row["exit_code"],
            )
            if row["done"]:
                if job.ended is None:
                    job.ended = shown
                self.expect(shown == job.ended, f"{job_id} ended as {job.ended}, now shows {shown}")
                self.check_ended(job, row)
            for step, loss in losses_by_step(job.run_dir, job_id).items():
                self.expect(
                    self.reference.get(step) == loss,
                    f"{job_id} step {step}: loss {loss!r}, an uninterrupted run's {self.reference.get(step)!r}",
                )
        self.check_checkpoints()
        self.check_private()
        self.check_code(rows)

    def check_ended(self, job: Job, row: dict[str, Any]) -> None:
        self.check_goodput(job)
        rules = {alert.get("rule") for alert in row.get("alerts") or ()}
        if row["state"] == "COMPLETED":
            self.expect("checkpoint_lost" not in rules, f"{job.job_id} COMPLETED with lost steps: {row['alerts']}")
            self.expect(row["exit_code"] in (0, None), f"{job.job_id} COMPLETED with exit {row['exit_code']}")
            if job.framework:  # it reports nothing: its own last line says whether it trained every epoch
                trained = framework_epochs(job.run_dir, final=True)
                self.expect(trained == FRAMEWORK_EPOCHS, f"{job.job_id} COMPLETED after {trained} epochs")
            else:
                self.expect(row["progress"].get("step") == STEPS, f"{job.job_id} COMPLETED at step {row['progress']}")
        reported = row["progress"].get("checkpoint_step")
        if reported is None:
            return
        complete = ckptdir.complete_steps(checkpoint_root(job.run_dir))
        later = [
            other
            for other in self.jobs.values()
            if other.run_dir == job.run_dir and other.job_id != job.job_id and other.parent is not None
        ]
        self.expect(
            reported in complete or bool(later) or "checkpoint_lost" in rules,
            f"{job.job_id} reports checkpoint {reported}, complete on disk: {complete}, and no alert says it is lost",
        )

    def check_goodput(self, job: Job) -> None:
        """An ended job's goodput record (where it has one: it started) adds up: no part negative, the parts
        sum to the allocated time within 1%, no more steps lost than computed."""
        path = Path(RunDir(str(job.run_dir)).goodput(job.job_id))
        try:
            good = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        parts = good["parts_s"]
        self.expect(all(v >= 0 for v in parts.values()), f"{job.job_id}'s goodput has a negative part: {good}")
        gap = abs(sum(parts.values()) - good["allocated_s"])
        self.expect(gap <= max(0.01 * good["allocated_s"], 0.01), f"{job.job_id}'s goodput parts do not add up: {good}")
        self.expect(0 <= good["lost_steps"] <= good["steps"], f"{job.job_id} lost more steps than it computed: {good}")

    def check_checkpoints(self) -> None:
        for run_dir in {job.run_dir for job in self.jobs.values()}:
            root = checkpoint_root(run_dir)
            for step in ckptdir.complete_steps(root):
                folder = ckptdir.step_dir(root, step)
                try:
                    marker = ckptdir.read_marker(folder)
                    size = (folder / ".metadata").stat().st_size
                except FileNotFoundError:
                    if not folder.exists():
                        continue  # retired by retention while it was read: a running job keeps the newest
                    self.expect(False, f"{folder} is marked complete without DCP metadata")
                self.expect(isinstance(marker, dict), f"{folder}: its marker is not a record")
                self.expect(size > 0, f"{folder} is marked complete with empty DCP metadata")

    def check_code(self, rows: dict[str, dict[str, Any]]) -> None:
        """The code a job runs from (its snapshot on Slurm, the project on `local`) is there, as first seen,
        while the job has not ended: a later submit never removes or replaces it."""
        if not self.site.ships_code:
            return
        for job_id, row in rows.items():
            job = self.jobs[job_id]
            folder = code_dir(job.run_dir)
            if row["done"] or folder is None:
                continue
            files = {
                str(path.relative_to(folder)): path.stat().st_size
                for path in folder.rglob("*")
                if path.is_file() and "__pycache__" not in path.parts
            }
            self.expect(bool(files), f"{job_id} runs from {folder}, which is gone or empty")
            if job.code is None:
                job.code = files
            self.expect(files == job.code, f"{job_id}'s code in {folder} changed while it ran")

    def check_private(self) -> None:
        mine = {job.run_dir for job in self.jobs.values()} | {
            checkpoint_root(job.run_dir) for job in self.jobs.values()
        }
        for top in (self.home / ".local" / "share" / "meshrun", self.home / "state" / "meshrun", *mine):
            for path in _walk(top):
                try:
                    mode = path.lstat().st_mode
                except FileNotFoundError:
                    continue  # removed while walking (a checkpoint retired)
                if stat.S_ISLNK(mode):
                    continue
                self.expect(mode & 0o077 == 0, f"{path} is {stat.filemode(mode)}: readable by other users")

    # --- the whole journey -----------------------------------------------------------------------------------

    def run(self, steps: int) -> None:
        self.decoy = subprocess.Popen(["sleep", "3600"], start_new_session=True)
        decoy = psutil.Process(self.decoy.pid)
        try:
            for _ in range(steps):
                self.step()
                self.check()
            self.finish()
            self.check()
            self.expect(decoy.is_running() and self.decoy.poll() is None, "a process outside the jobs was signalled")
        finally:
            self.decoy.kill()
            self.decoy.wait()
            self.stop_everything()

    def finish(self) -> None:
        """The end: the running jobs run out (or are cancelled when they take long), all end."""
        for job in self.running(self.rows()):
            try:
                self.wait_until(f"{job.job_id} ends", lambda job=job: self.ended(job), timeout=90, final=True)
            except JourneyFailed:
                self.cancel(job)

    def stop_everything(self) -> None:
        """Whatever a failed journey left running: cancelled by meshrun, then any survivor killed."""
        tbhelp.stop(tbhelp.servers(under=[self.home]))
        for job in self.jobs.values():
            meshrun(self.home, "cancel", job.job_id, laptop=self.site.laptop)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(processes_of(self.site, job, None) for job in self.jobs.values()):
            time.sleep(0.5)
        for job in self.jobs.values():
            for proc in processes_of(self.site, job, None):
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass


def processes_of(site: Site, job: Job, role: Optional[str]) -> list[psutil.Process]:
    """The live processes of a job (every one carries its id in `site.job_env`), of one role or all. On
    `local` the ranks are the rank controller's forked children (its command line, its child)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or proc.environ().get(site.job_env) != job.job_id:
                continue
            kind = _role(site, proc.cmdline())
            parent = proc.parent()
            if kind == "controller" and parent is not None and _role(site, parent.cmdline()) == "controller":
                kind = "rank"
        except psutil.Error:
            continue
        if role is None or kind == role:
            found.append(proc)
    return found


def _role(site: Site, argv: list[str]) -> str:
    if argv and os.path.basename(argv[0]) in ("srun", "slurmstepd"):
        return "slurm"  # Slurm's own: never a journey's target
    line = " ".join(argv)
    return next((role for role, word in site.roles.items() if word in line), "other")


def _sacct_state(job_id: str) -> str:
    done = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id], capture_output=True, text=True)
    words = done.stdout.split()
    return words[-1] if words else ""


def reference_losses(site: Site, home: Path, corpus: Path) -> dict[int, float]:
    """Every step's loss in one uninterrupted run of the journeys' job at `site`: what any job must log then."""
    done = meshrun(home, "submit", *spec_args(site, corpus), "--wait", check=True, laptop=site.laptop)
    job_id, run_dir = submitted(done)
    losses = losses_by_step(run_dir, job_id)
    assert sorted(losses) == list(range(1, STEPS + 1)), losses
    return losses


def _on_cluster(spec: tuple[str, ...], cluster: str) -> tuple[str, ...]:
    """The spec's arguments with its `-c CLUSTER` replaced."""
    words = list(spec)
    words[words.index("-c") + 1] = cluster
    return tuple(words)


def code_dir(run_dir: Path) -> Optional[Path]:
    """The folder the job's ranks run from, as its rendered script exports it (MESHRUN_CODE_DIR)."""
    for script in run_dir.glob("job.*"):
        for line in script.read_text(errors="replace").splitlines():
            if line.startswith("export MESHRUN_CODE_DIR="):
                return Path(line.split("=", 1)[1].strip("'\""))
    return None


def _walk(top: Path) -> list[Path]:
    """`top` and everything under it, as far as it still exists: a running job retires checkpoints and
    replaces files while the walk goes (rglob raised on a folder removed under it)."""
    found = [top] if top.exists() else []
    for folder, dirs, files in os.walk(top, onerror=lambda _error: None):
        found += [Path(folder, name) for name in (*dirs, *files)]
    return found
