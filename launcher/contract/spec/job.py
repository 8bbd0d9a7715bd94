"""The job spec: the one contract between `submit` (which validates and plans it)
and the launcher (which runs it). Torch-free and stdlib-only.

A job spec never names a host; a cluster profile never names a model.
The planner writes the resolved spec as `spec.json` into the run dir, together
with a `RunInfo` section that carries what the ranks need from the cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Optional

from meshrun.launcher.contract.spec import SPEC_FILE
from meshrun.launcher.contract.spec.parallel_dims import ParallelDims, Problem
from meshrun.launcher.contract.spec.schema import SchemaError, bounded, load, to_plain, upgrade_renamed
from meshrun.launcher.contract.spec.secrets import ENV_KEY, parse_secrets

Precision = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Resources:
    nodes: int = bounded(1, "must be at least 1", at_least=1)
    """Number of nodes."""
    gpus_per_node: int = bounded(0, "must be at least 0", at_least=0)
    """GPUs per node; 0 trains on CPU ranks (gloo)."""
    tasks_per_node: Optional[int] = bounded(None, "must be at least 1", at_least=1)
    """Ranks per node; defaults to gpus_per_node (one rank per GPU). Required for CPU jobs."""
    cpus_per_task: int = bounded(1, "must be at least 1", at_least=1)
    """CPU cores per rank (data loading threads, the CPU math of CPU jobs)."""
    time: str = "01:00:00"
    """Wall-clock limit, in Slurm's syntax: MM, HH:MM:SS or D-HH:MM:SS."""
    partition: Optional[str] = None
    """Partition; the cluster's default partition when unset."""
    memory_gb: Optional[int] = None
    """Memory per node in GiB; the partition's default when unset."""


@dataclass(frozen=True)
class Parallel:
    dp: int = bounded(1, "must be at least 1", at_least=1)
    """Data-parallel degree."""
    tp: int = bounded(1, "must be at least 1", at_least=1)
    """Tensor-parallel degree (kept inside one NVLink/NVSwitch domain)."""
    pp: int = bounded(1, "must be at least 1", at_least=1)
    """Pipeline-parallel degree (must divide the number of layers)."""
    dp_mode: Literal["fsdp", "ddp"] = "fsdp"
    """How data parallelism keeps parameters: fsdp (FSDP2 fully_shard, ZeRO-3-like) or ddp (replicated:
    torch DDP, or FSDP2's replicate when tp or pp > 1)."""
    sequence_parallel: bool = False
    """With tp > 1, also split norms and the residual stream over the sequence (seq_len must divide by tp)."""
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule when pp > 1; its micro-batches are the step's accumulation micro-batches."""
    zero: Optional[int] = None
    """DeepSpeed ZeRO stage 0-3 (train.engine: deepspeed only; unset: 2). The native engine shards with
    dp_mode instead (fsdp is ZeRO-3-like, ddp ZeRO-0)."""
    offload_optimizer: bool = False
    """DeepSpeed: keep the optimizer state (and its step) in CPU memory (ZeRO 1-3)."""
    offload_params: bool = False
    """DeepSpeed: keep the parameters in CPU memory between uses (ZeRO-3 only): models larger than the GPUs."""


@dataclass(frozen=True)
class Model:
    n_layers: int = bounded(4, "must be at least 1", at_least=1)
    """Transformer blocks."""
    d_model: int = bounded(128, "must be at least 1", at_least=1)
    """Hidden size."""
    n_heads: int = bounded(4, "must be at least 1", at_least=1)
    """Attention heads (d_model must be divisible by it, and it by tp)."""
    vocab_size: int = bounded(256, "give the vocabulary size, or 0: the tokenizer's", at_least=0)
    """Vocabulary size; 256 for a byte-level token file. 0 takes it from the tokenizer `meshrun data` saved
    beside data.path (its `.json` record)."""
    n_kv_heads: int = 0
    """Key/value heads: fewer than n_heads is grouped-query attention (n_heads must be divisible by it, and
    it by tp); 0 means n_heads (full multi-head attention)."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output head (GPT-2, small Llamas); pp must be 1."""
    rope_theta: float = bounded(10000.0, "give a base above 1, e.g. 10000 or 500000", above=1, at_most=1e9)
    """Rotary embeddings' base (Llama 2: 10000, Llama 3: 500000)."""
    seq_len: int = bounded(128, "must be at least 1", at_least=1)
    """Tokens per training sequence."""
    ffn_mult: float = 2.6667
    """SwiGLU hidden size as a multiple of d_model (rounded up to a multiple of 64)."""
    preset: Optional[str] = None
    """A model-size preset (llama-7b, llama-70b, gpt2-small, ...: launcher/contract/spec/presets.py) setting the keys above;
    expanded when the spec is loaded, keys given explicitly win."""

    def __post_init__(self) -> None:
        if self.n_kv_heads < 0 or (self.n_kv_heads and self.n_heads % self.n_kv_heads):
            raise SchemaError(
                "train.model.n_kv_heads",
                self.n_kv_heads,
                f"give a divisor of n_heads ({self.n_heads}), or 0 for full multi-head attention",
            )

    @property
    def kv_heads(self) -> int:
        """Key/value heads, n_kv_heads resolved (0: one per query head)."""
        return self.n_kv_heads or self.n_heads


Engine = Literal["native", "deepspeed"]


@dataclass(frozen=True)
class Train:
    model: Model = field(default_factory=Model)
    """The GPT-style model to train."""
    engine: Engine = "native"
    """native (FSDP2/DDP + DTensor TP + pipelining) or deepspeed (ZeRO 0-3, CPU offload; dp only)."""
    steps: int = bounded(100, "must be at least 1", at_least=1)
    """Optimizer steps."""
    precision: Precision = "fp32"
    """fp32, bf16 or fp16 (mixed precision on GPUs; CPU runs use fp32 math)."""
    global_batch: int = bounded(8, "must be at least 1", at_least=1)
    """Sequences per optimizer step, across all data-parallel ranks (as in Megatron)."""
    micro_batch: int = bounded(2, "must be at least 1", at_least=1)
    """Sequences per forward/backward on one data-parallel rank; accumulation = global/(micro*dp)."""
    lr: float = bounded(3e-4, "the learning rate must be positive, e.g. 3e-4", above=0)
    """Peak learning rate."""
    min_lr: float = bounded(3e-5, "must be at least 0 (the cosine schedule's floor; e.g. lr / 10)", at_least=0)
    """Learning rate at the end of the cosine schedule."""
    warmup_steps: int = bounded(10, "must be at least 0 (0: no warmup)", at_least=0)
    """Linear warmup steps."""
    weight_decay: float = bounded(0.1, "must be at least 0 (0: no decay; e.g. 0.1)", at_least=0)
    """AdamW weight decay (never applied to norms and biases)."""
    grad_clip: float = bounded(1.0, "must be at least 0 (0 turns clipping off; e.g. 1.0)", at_least=0)
    """Clip the global gradient norm to this; 0 disables clipping."""
    log_every: int = bounded(1, "must be at least 1", at_least=1)
    """Write a metrics.jsonl line every N steps."""
    eval_every: int = bounded(0, "must be at least 0 (0: no validation)", at_least=0)
    """Validation loss every N steps; 0 disables."""
    eval_sequences: int = 128
    """Validation sequences per evaluation: the first ones of the held-out split, cut to a multiple of global_batch."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward to save memory."""
    seed: int = 0
    """Random seed (model init, data order)."""
    init_from: Optional[str] = None
    """Start from these weights (a safetensors file in meshrun's or Hugging Face Llama naming, as the ranks
    see it) instead of a random init: fine-tuning. Ignored once the run has a checkpoint to resume."""


@dataclass(frozen=True)
class BlendSource:
    """One token file of a blend."""

    path: str
    """A token file as the ranks see it (built by `meshrun data`)."""
    weight: float = 1.0
    """Its share of the training sequences, relative to the other files' weights (above 0)."""


DEFAULT_DATA_PATH = "~/.cache/meshrun/data/stdlib.u16"
"""The examples' token file: what `meshrun data` writes by default and a spec reads when it names none."""


@dataclass(frozen=True)
class Data:
    path: str = DEFAULT_DATA_PATH
    """Token file as seen by the ranks (uint16 or uint32 tokens); build one with `meshrun data`."""
    val_path: Optional[str] = None
    """A separate validation token file. Unset: the held-out documents `meshrun data` wrote beside `path`
    (its `.json` record names them), else the tail `val_fraction` of `path`."""
    val_fraction: float = bounded(0.05, "use a fraction in [0, 1), e.g. 0.05", at_least=0, below=1)
    """Fraction held out for validation from a token file that has no held-out file (the tail of the stream)."""
    blend: tuple[BlendSource, ...] = ()
    """Train on several token files mixed by weight (deterministic, resumable, the same for any layout)
    instead of `path` alone; validation still comes from `path` (or `val_path`)."""


@dataclass(frozen=True)
class Checkpoint:
    every: int = bounded(0, "must be at least 0 (0 saves only at the end and on preemption), e.g. 500", at_least=0)
    """Save every N steps; 0 saves only at the end and on preemption."""
    keep: int = bounded(
        3, "keep at least 1 complete checkpoint (the one a requeued job resumes from), e.g. 3", at_least=1
    )
    """Keep the newest K complete checkpoints."""
    keep_every: int = bounded(0, "must be at least 0 (0 keeps nothing beyond checkpoint.keep), e.g. 1000", at_least=0)
    """Also keep every checkpoint whose step is a multiple of this (0: none beyond `keep`)."""
    async_save: bool = True
    """Save in the background: training waits only while the state is copied to CPU memory."""
    resume_step: Optional[int] = bounded(
        None,
        "checkpoints are numbered by the step after which they were saved, from 1: give a step >= 1, or null to "
        "resume from the newest complete checkpoint",
        at_least=1,
    )
    """Resume from exactly this step (it must be complete); the newest complete one when unset."""
    keep_best: bool = False
    """Also keep the complete checkpoint with the lowest validation loss (its marker records it); never retained away."""
    max_requeues: int = bounded(20, "must be at least 0 (0 never requeues), e.g. 20", at_least=0)
    """Requeue the job at most this many times (preemption, time limit, failure) before stopping;
    `resilience.max_restarts` counts the restarts inside one allocation."""

    RENAMED: ClassVar[dict[str, str]] = {"max_restarts": "max_requeues"}
    """Keys this section once had, refused with their new name: `checkpoint.max_restarts` shared its name with
    `resilience.max_restarts`, another count."""


@dataclass(frozen=True)
class Code:
    """The project code shipped with the job (read by `submit` only; the ranks just run it)."""

    sync: bool = True
    """Ship a content-addressed snapshot of the project to the cluster's work dir (Slurm clusters)."""
    root: Optional[str] = None
    """Project folder, relative to the job spec's folder; default: the git work tree holding the spec
    (no snapshot when the spec is in none)."""
    include: tuple[str, ...] = ()
    """Extra files to ship, as globs relative to the root (in a git tree: on top of git's files)."""
    exclude: tuple[str, ...] = ()
    """Files never shipped, as globs relative to the root (`*` crosses folders; `data` drops a folder)."""


@dataclass(frozen=True)
class Sidecar:
    """The per-node sidecar (GPU and host metrics, the environment record): `python -m meshrun.launcher.sidecar`."""

    interval_s: float = bounded(5.0, "give 0.1 to 3600 seconds (default 5)", at_least=0.1, at_most=3600)
    """Seconds between samples (gpu.jsonl, TensorBoard); 0.1-3600. Shorter costs the ranks more CPU."""
    final_copy_s: float = bounded(300.0, "give 0 to 86400 seconds (default 300)", at_least=0, at_most=86400)
    """When the ranks end, how long the sidecar may still copy checkpoints staged on scratch to shared storage."""


RESTART_ON = ("failure", "hang", "health")
"""What may restart a job inside its allocation (resilience.restart_on)."""


@dataclass(frozen=True)
class Resilience:
    """Keeping a long job productive across failures (docs/guides/hangs-and-alerts.md: suspect nodes)."""

    forget_after_h: float = bounded(24.0, "give 0 to 8760 hours (default 24)", at_least=0, at_most=8760)
    """A node a hang verdict blamed stays in the cluster's ledger of suspects, left out of new submits, for this
    many hours after its last finding (then it is tried again); 0-8760. `meshrun nodes --clear` clears it."""
    avoid_suspects: bool = True
    """Leave the cluster's suspect nodes out of this job (as many as its partition can spare)."""
    health_check: bool = True
    """On Slurm, before each start (the first and every requeue) every node checks its GPUs, free space, storage,
    Python environment and clock; a failing node is excluded and the job requeued (docs/guides/hangs-and-alerts.md)."""
    health_timeout_s: float = bounded(120.0, "give 10 to 1800 seconds (default 120)", at_least=10, at_most=1800)
    """A node that has not answered its health check in this many seconds fails it; 10-1800."""
    min_free_gb: float = bounded(0.0, "give 0 (two checkpoints' worth) to 1000000 GB", at_least=0, at_most=1e6)
    """Free space each node needs on the checkpoint root and its scratch, in GB; 0: two checkpoints' worth,
    estimated from the model (at least 1 GB)."""
    spare_nodes: int = bounded(0, "give 0 to 1024 nodes (default 0)", at_least=0, at_most=1024)
    """Nodes allocated beyond resources.nodes (Slurm): a failed node's ranks restart on a spare inside the same
    allocation, from the last complete checkpoint, instead of waiting in the queue again; 0-1024."""
    max_restarts: int = bounded(3, "give 0 to 100 restarts (default 3)", at_least=0, at_most=100)
    """Restarts inside one allocation (with spare_nodes) before the job falls back to a requeue; 0-100."""
    restart_on: tuple[str, ...] = ("failure", "hang", "health")
    """What restarts inside the allocation: a rank's failure, a hang verdict (exit 76), a node failing its
    health check; anything else (bad input, a crash loop, divergence) never does."""

    def __post_init__(self) -> None:
        unknown = [word for word in self.restart_on if word not in RESTART_ON]
        if unknown:
            raise SchemaError("resilience.restart_on", unknown[0], f"give some of {', '.join(RESTART_ON)}")
        repeated = [word for word in RESTART_ON if self.restart_on.count(word) > 1]
        if repeated:
            raise SchemaError("resilience.restart_on", repeated[0], "name each at most once")
        if self.spare_nodes and (self.max_restarts == 0 or not self.restart_on):
            raise SchemaError(
                "resilience.spare_nodes",
                self.spare_nodes,
                "spares serve only restarts inside the allocation: give resilience.max_restarts >= 1 and a "
                "restart_on, or 0 spares (a spare is allocated, and billed, while it idles)",
            )


WEEK_S = 7 * 86400
SECONDS_1_TO_WEEK = "give 1 to 604800 seconds"
FACTOR_OR_OFF = "give a factor above 1 (e.g. 3), or 0 to turn the rule off"
FRACTION_OR_OFF = "give a fraction between 0 and 1 (0 turns the rule off)"


@dataclass(frozen=True)
class Watchdog:
    """Hang and straggler detection by each node's sidecar, from the ranks' heartbeats (docs/guides/hangs-and-alerts.md)."""

    enabled: bool = True
    """Declare a hang (diagnose, then end the job with exit 76 for a requeue) when no rank progresses in time."""
    step_factor: float = bounded(5.0, "give a multiple of 1 to 1000 (default 5)", at_least=1, at_most=1000)
    """A step hangs after step_factor x the median recent step time + step_floor_s (at least 2x the slowest)."""
    step_floor_s: float = bounded(60.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """Added to every step timeout: a pause in the first steps or a slow logging step is not a hang."""
    setup_timeout_s: float = bounded(1200.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """Start-up (process group, model build, resume) may take this long before the first step."""
    eval_timeout_s: float = bounded(1200.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """One validation pass may take this long."""
    checkpoint_timeout_s: float = bounded(1200.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """One checkpoint save may take this long."""
    straggler_factor: float = bounded(1.5, "give a factor above 1, at most 100 (default 1.5)", above=1, at_most=100)
    """A rank whose recent busy time per step exceeds this multiple of all ranks' median is named a straggler."""
    straggler_check_s: float = bounded(10.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """How often each node shares its ranks' step times and stragglers are looked for (named after 3 checks)."""
    diagnosis_wait_s: float = bounded(30.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """How long the node that found the hang waits for every node's part of the diagnosis before the verdict."""
    rendezvous_stall_s: float = bounded(60.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """A rendezvous that some ranks reached this long ago and none has completed is a hang: the sidecars name the
    nodes whose ranks did not join (the built-in trainer's ranks say when they reach and leave it)."""
    rendezvous_timeout_s: float = bounded(180.0, SECONDS_1_TO_WEEK, at_least=1, at_most=WEEK_S)
    """Each rank of the built-in trainer waits this long for the rendezvous (rank 0's store, every rank in it), then
    exits 76 naming the ranks that did not join, also when the hang watch is off."""


@dataclass(frozen=True)
class Alerts:
    """Rules over what the job records; each writes RUN_DIR/alerts.jsonl and a log line (docs/guides/hangs-and-alerts.md).
    A rule is off at 0 (or false)."""

    loss_spike_factor: float = bounded(3.0, FACTOR_OR_OFF, above=1, at_most=1e6, or_exactly=0)
    """Alert when the loss exceeds this multiple of its median over the last `window` logged steps."""
    grad_norm_spike_factor: float = bounded(10.0, FACTOR_OR_OFF, above=1, at_most=1e6, or_exactly=0)
    """Alert when the grad norm exceeds this multiple of its median over the last `window` logged steps."""
    window: int = bounded(50, "give 2 to 100000 logged steps (default 50)", at_least=2, at_most=100000)
    """Logged steps the spike rules take their median over (they wait for 10 before judging)."""
    val_patience: int = bounded(5, "give evaluations >= 1, or 0 to turn it off", at_least=0, at_most=100000)
    """Alert when the validation loss has not improved over this many evaluations."""
    data_wait_fraction: float = bounded(0.2, FRACTION_OR_OFF, at_least=0, below=1)
    """Alert when the data wait takes more than this fraction of the step time (3 logged steps in a row)."""
    gpu_util_below_pct: float = bounded(30.0, "give 0-100 percent (0: off)", at_least=0, at_most=100)
    """Alert when a GPU's utilisation stays below this for `gpu_util_minutes` (the sidecar)."""
    gpu_util_minutes: float = bounded(10.0, "give minutes above 0, at most a week", above=0, at_most=10080)
    """How long, in minutes, a GPU's utilisation must stay below `gpu_util_below_pct` before the alert."""
    gpu_memory_fraction: float = bounded(0.95, FRACTION_OR_OFF, at_least=0, below=1)
    """Alert when a GPU's memory used exceeds this fraction of its capacity (the sidecar)."""
    stragglers: bool = True
    """Alert when the sidecar names a straggler."""
    hangs: bool = True
    """Alert when the sidecar declares a hang."""
    plan_drift: float = bounded(0.3, "give a fraction such as 0.3 (30%), or 0 to turn it off", at_least=0, at_most=100)
    """Alert when the measured step time (or a GPU's peak memory) is off the plan's prediction by more than this
    fraction either way, naming the term that is off (launcher/train/plancheck.py); 0: no alert, the ratio is
    still measured and shown."""
    plan_check_steps: int = bounded(50, "give 1 to 1000000 steps (default 50)", at_least=1, at_most=1_000_000)
    """Steps rank 0 measures (after the attempt's first few, its warm-up) before comparing them with the plan."""


@dataclass(frozen=True)
class JobSpec:
    name: str
    """Job name, shown by Slurm and meshrun; any printable text (it is quoted, never executed)."""
    resources: Resources = field(default_factory=Resources)
    """What to ask the scheduler for."""
    parallel: Parallel = field(default_factory=Parallel)
    """How the ranks split the model and the data: dp x tp x pp must equal the rank count."""
    train: Optional[Train] = None
    """The built-in GPT trainer's settings (exclusive with `command`)."""
    command: Optional[tuple[str, ...]] = None
    """Your own program as an argv list, run on every rank with torchrun-compatible variables."""
    command_steps: Optional[int] = bounded(
        None, "give the step your program reports last (1 or more)", at_least=1, at_most=10**12
    )
    """A `command:` job's last step, when it has one: once the program has reported it (meshrun.launcher.report), an exit 0
    is a finish even after a stop signal. Without it, or a call of meshrun.launcher.job.finished(), an exit 0 after a
    preemption or the time limit's warning is a stop and the job is requeued (frameworks leave their loop on
    SIGTERM and exit 0 with work left)."""
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    """Checkpoint cadence and retention."""
    data: Data = field(default_factory=Data)
    """Training data."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment variables for every rank (never put secrets here: scripts are readable)."""
    secrets: Any = field(default_factory=dict)
    """Secret environment variables for every rank, by name: where each value comes from ({file: PATH} or
    {env: NAME}), never the value itself; set at rank start, written nowhere (launcher/contract/spec/secrets.py). Loaded
    as {NAME: SecretSource} by meshrun.launcher.contract.spec.secrets.parse_secrets, not by the schema (Any here): its errors would
    echo a value written where a source belongs."""
    code: Code = field(default_factory=Code)
    """Which project files are shipped to the cluster with the job."""
    sidecar: Sidecar = field(default_factory=Sidecar)
    """The per-node sidecar's settings (sampling interval, the final checkpoint copy)."""
    watchdog: Watchdog = field(default_factory=Watchdog)
    """Hang and straggler detection (the sidecar, from the ranks' heartbeats)."""
    resilience: Resilience = field(default_factory=Resilience)
    """Keeping the allocation: spare nodes and restarts inside it, the health gate before each start, and the
    suspect nodes a job leaves out (docs/guides/hangs-and-alerts.md)."""
    alerts: Alerts = field(default_factory=Alerts)
    """Alert rules and their thresholds (alerts.jsonl, the rank-0 log, status, `meshrun watch --notify`)."""
    deepspeed: Mapping[str, Any] = field(default_factory=dict)
    """DeepSpeed config keys over the generated ones (train.engine: deepspeed); keys the spec already sets
    (batch sizes, ZeRO stage, offload, precision, clipping) are refused: set them in the spec."""

    def __post_init__(self) -> None:
        if not self.name.strip() or len(self.name) > 128:
            raise SchemaError("name", self.name, "give the job a name of 1-128 characters")
        for key in self.env:
            if not ENV_KEY.fullmatch(key):
                raise SchemaError(f"env.{key}", key, "environment variable names match [A-Za-z_][A-Za-z0-9_]*")
        object.__setattr__(self, "secrets", parse_secrets(self.secrets, self.env))  # typed, checked here
        if self.train is not None and self.command is not None:
            raise SchemaError(
                "command",
                list(self.command),
                "give either `train` or `command`, not both: drop the spec's `train:` section (or `--set train=null`)",
            )
        if self.command is not None and not self.command:
            raise SchemaError("command", [], "give the program and its arguments, e.g. [python, train.py]")
        if self.command_steps is not None and self.command is None:
            raise SchemaError(
                "command_steps",
                self.command_steps,
                "it is a `command:` job's last step; the built-in trainer's is train.steps",
            )
        from meshrun.launcher.contract.spec import dsconfig  # here, not at the top: dsconfig reads JobSpec

        dsconfig.check(self)

    @property
    def dims(self) -> ParallelDims:
        """The dp x tp x pp layout the spec asks for: the one place a job's ParallelDims is built."""
        p = self.parallel
        return ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp)

    def layout_problem(
        self,
        dims: Optional[ParallelDims] = None,
        *,
        world_size: Optional[int] = None,
        ranks_per_node: Optional[int] = None,
        sequence_parallel: Optional[bool] = None,
    ) -> Optional[Problem]:
        """The first thing wrong with a layout for this job's model (default: the spec's own layout, on the
        spec's world and nodes): what the planner, the layout search, the mesh count and every rank check."""
        model = self.trainer.model
        return (dims or self.dims).problem(
            self.world_size if world_size is None else world_size,
            model.n_layers,
            model.n_heads,
            self.tasks_per_node if ranks_per_node is None else ranks_per_node,
            vocab_size=model.vocab_size,
            seq_len=model.seq_len,
            sequence_parallel=self.parallel.sequence_parallel if sequence_parallel is None else sequence_parallel,
            n_kv_heads=model.n_kv_heads,
            tie_embeddings=model.tie_embeddings,
        )

    @property
    def trainer(self) -> Train:
        """The trainer settings; the defaults when a spec gives neither train nor command."""
        return self.train if self.train is not None else Train()

    @property
    def tasks_per_node(self) -> int:
        r = self.resources
        return r.tasks_per_node if r.tasks_per_node is not None else max(r.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.resources.nodes * self.tasks_per_node


@dataclass(frozen=True)
class Prediction:
    """The plan's figures for one optimizer step of this job (submit/planning/steptime.py): rank 0 compares them
    with what it measures after alerts.plan_check_steps steps (launcher/train/plancheck.py)."""

    step_s: float
    """The step time."""
    tokens_per_s: float
    """global_batch x seq_len / step_s."""
    compute_s: float
    """The ranks' own work in a step: the matmuls and the optimizer step."""
    communication_s: float
    """What a step waits on besides its own work: collectives not hidden behind compute, the pipeline's bubble."""
    memory_bytes: Optional[int] = None
    """Peak memory of one GPU (the plan's fullest pipeline stage); None on CPU ranks (not predicted)."""
    figures: str = ""
    """Where the figures came from: "datasheet figures", or "calibrated on DATE (...)" (`meshrun doctor`'s)."""


@dataclass(frozen=True)
class RunInfo:
    """What the planner adds for the ranks: filled on the caller's machine, read on the cluster."""

    cluster: str
    """Cluster profile name."""
    scheduler: Literal["slurm", "local"]
    """How the job was started."""
    run_dir: str
    """The run dir on the cluster (logs, metrics, checkpoints)."""
    nccl_env: Mapping[str, str] = field(default_factory=dict)
    """The cluster's NCCL/network preset, applied by each rank before init unless already set."""
    checkpoint_dir: str = ""
    """Where checkpoints go (the cluster's shared checkpoint root, or run_dir/checkpoints)."""
    time_limit_s: int = 0
    """The job's time limit in seconds (the local supervisor enforces it; Slurm does on a cluster)."""
    meshrun_version: str = ""
    """The meshrun that planned and rendered the job; a rank running another one says so in its log
    ("" in a spec.json written before meshrun recorded it)."""
    scratch_dir: str = ""
    """This run's folder on each node's local scratch (the profile's paths.scratch); "" when the cluster has
    none. Each node uses SCRATCH_DIR/NODE (meshrun.launcher.contract.records.rundir.RunDir.node_dir): checkpoints are staged there."""
    gpu_type: str = ""
    """The partition's GPU type from the cluster profile (h100, h200, ...): MFU is measured against its
    peak (meshrun.launcher.contract.gpus); "" when the profile names none (then the device's own name is looked up)."""
    suspects_file: str = ""
    """The cluster's ledger of suspect nodes (WORK_DIR/.meshrun/suspect-nodes.jsonl: launcher/contract/records/suspects.py),
    where a hang verdict records the nodes it blames ("" in a spec.json written before there was one)."""
    gpu_hour_price: float = 0.0
    """What one GPU-hour costs on this cluster (the profile's cost.gpu_hour; 0: not priced), in `currency`: the
    sidecar's TensorBoard and `meshrun status` show what the job has cost so far."""
    currency: str = ""
    """The price's currency (the profile's cost.currency)."""
    prediction: Optional[Prediction] = None
    """The plan's step time and memory for this job, where the planner knows the hardware (a trainer job on a GPU
    partition it knows, or a CPU partition `meshrun doctor` calibrated); None: nothing to check the run against."""


@dataclass(frozen=True)
class RunSpec:
    """The file `spec.json` in a run dir: the job as planned plus the run info."""

    job: JobSpec
    run: RunInfo


def dumps_run_spec(run_spec: RunSpec) -> str:
    plain = to_plain(run_spec)
    # A job without secrets writes the spec.json it wrote before the key existed: the same rendered
    # script, and a cluster whose launcher predates the key still reads it (loading fills the default).
    if not plain["job"]["secrets"]:
        del plain["job"]["secrets"]
    if plain["run"]["prediction"] is None:  # the same: a job the planner cannot time writes what it wrote before
        del plain["run"]["prediction"]
    if not plain["run"]["gpu_hour_price"]:  # and one on a cluster without prices
        del plain["run"]["gpu_hour_price"], plain["run"]["currency"]
    return json.dumps(plain, indent=2, sort_keys=True) + "\n"


def write_run_spec(run_spec: RunSpec, run_dir: Path) -> Path:
    path = Path(run_dir) / SPEC_FILE
    path.write_text(dumps_run_spec(run_spec))
    return path


class SpecFileError(SchemaError):
    """spec.json is missing, unreadable or invalid: one line naming the file and the fix.

    A SchemaError, so every caller that treats bad input as exit 2 treats this one so too.
    """

    def __init__(self, path: str, problem: str, fix: str) -> None:
        self.key, self.value, self.fix = path, problem, fix
        ValueError.__init__(self, f"{path}: {problem}; {fix}")

    def __reduce__(self) -> tuple[object, ...]:  # picklable (submitit ships a rank's exception)
        return (type(self), (self.key, self.value, self.fix))


_RESUBMIT = "it is written by `meshrun submit`: restore it, or submit the job again"


def loads_run_spec(text: str, source: str) -> RunSpec:
    """Parse and validate a spec.json's text; `source` names the file in the error."""
    try:
        data = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and a UnicodeDecodeError from bytes
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise SpecFileError(source, f"not valid JSON{where} (truncated or edited by hand?)", _RESUBMIT) from None
    if not isinstance(data, dict):
        raise SpecFileError(source, f"expected a JSON object, found {type(data).__name__}", _RESUBMIT)
    try:
        return load(RunSpec, upgrade_renamed(RunSpec, data))  # a run dir from before a key's rename still runs
    except SchemaError as exc:
        raise SpecFileError(source, str(exc), "edit that key back, or submit the job again") from None


def read_run_spec(run_dir: Path) -> RunSpec:
    """The run spec of `run_dir`; SpecFileError (one line, names the file) if it cannot be used."""
    path = Path(run_dir) / SPEC_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecFileError(str(path), "no run spec there", f"is {run_dir} a meshrun run dir?") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecFileError(str(path), f"cannot be read ({exc})", _RESUBMIT) from None
    return loads_run_spec(text, str(path))


def check_ranges(spec: JobSpec) -> None:
    """What no one field says alone, refused naming its key, the value and the fix: what the planner checks
    before anything is sent (and a resume's --set before it is applied). A number's own range is declared once
    beside its field (`bounded`) and checked as the spec is loaded."""
    if spec.command is None and not (spec.data.path.startswith(("/", "~/")) or spec.data.path == "~"):
        # The ranks run elsewhere (another cwd, another machine): a relative path means nothing there.
        raise SchemaError(
            "data.path",
            spec.data.path,
            f"give an absolute path as the ranks see it (or ~/...), e.g. /shared/data/{Path(spec.data.path).name}",
        )
    if spec.command is None:
        _check_train_ranges(spec)


def _check_train_ranges(spec: JobSpec) -> None:
    t, m = spec.trainer, spec.trainer.model
    if t.eval_every > 0 and t.eval_sequences < t.global_batch:
        raise SchemaError(
            "train.eval_sequences",
            t.eval_sequences,
            f"validation runs whole global batches, so it needs at least train.global_batch "
            f"({t.global_batch}) sequences; set eval_sequences >= {t.global_batch} "
            f"or train.eval_every: 0",
        )
    if m.d_model % m.n_heads:
        raise SchemaError(
            "train.model.d_model",
            m.d_model,
            f"must be divisible by train.model.n_heads ({m.n_heads}): "
            f"{m.d_model} % {m.n_heads} = {m.d_model % m.n_heads}",
        )
    if (m.d_model // m.n_heads) % 2:
        raise SchemaError(
            "train.model.d_model",
            m.d_model,
            f"head size d_model/n_heads = {m.d_model // m.n_heads} must be even for rotary embeddings",
        )
