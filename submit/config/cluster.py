"""Cluster profiles: frozen typed dataclasses and their strict YAML loader.

Profiles come from the shipped `cluster_configs/` and from the user's
`$XDG_CONFIG_HOME/meshrun/clusters/` (a user profile of the same name wins).
A profile never names a model.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Optional, Sequence

from meshrun.launcher.contract.spec import schema
from meshrun.launcher.contract.spec.schema import SchemaError, bounded
from meshrun.launcher.contract.spec.secrets import ENV_KEY
from meshrun.submit.config.resources import shipped_profiles_dir
from meshrun.submit.config.yamlfile import YamlDoc
from meshrun.submit.errors import InputError
from meshrun.submit.folders import config_dir

SHIPPED_DIR = shipped_profiles_dir()  # package data: a wheel's or a checkout's cluster_configs/
PROFILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
CURRENCY = re.compile(r"[A-Za-z]{1,12}")
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A node name for --exclude: needs no quoting (sbatch's #SBATCH parser knows none), so no hostlist ranges."""


@dataclass(frozen=True)
class Ssh:
    host: str
    """Login node host name or a Host alias from ~/.ssh/config."""
    user: Optional[str] = None
    """Remote user; ~/.ssh/config or the local user when unset."""
    port: Optional[int] = None
    """SSH port; ~/.ssh/config or 22 when unset."""
    identity_file: Optional[str] = None
    """Private key file; the agent and ~/.ssh/config are used too."""
    proxy_jump: Optional[str] = None
    """Bastion as user@host[:port], like ssh -J."""
    known_hosts: str = "~/.ssh/known_hosts"
    """Host keys are verified against this file; unknown hosts are refused (see `meshrun trust`)."""
    timeout_s: float = 15.0
    """Seconds to wait for the connection (TCP, banner, authentication) before giving up."""


@dataclass(frozen=True)
class Paths:
    work_dir: str
    """Shared storage on the cluster where run dirs and code snapshots live."""
    checkpoint_root: Optional[str] = None
    """Shared storage for checkpoints; <run dir>/checkpoints when unset."""
    scratch: Optional[str] = None
    """Node-local scratch (fast disk) for staging, e.g. /tmp or /scratch/$USER."""


@dataclass(frozen=True)
class Partition:
    name: str
    """Slurm partition name."""
    gpus_per_node: int = 0
    """GPUs on each node of this partition."""
    gpu_type: Optional[str] = None
    """GPU model, e.g. h100 or h200 (used for --gres type and peak-FLOP figures)."""
    gpu_memory_gb: Optional[int] = None
    """Memory of one GPU in GiB."""
    cpus_per_node: int = 1
    """CPU cores per node."""
    memory_gb: Optional[int] = None
    """Memory per node in GiB."""
    max_time: Optional[str] = None
    """Longest time limit a job may ask for (Slurm syntax); unlimited when unset."""
    max_nodes: Optional[int] = None
    """Most nodes one job may ask for; unlimited when unset."""
    default: bool = False
    """The partition used when a job names none."""


@dataclass(frozen=True)
class Interconnect:
    nvlink_domain: int = 1
    """GPUs joined by NVLink/NVSwitch (tensor parallelism must stay inside one domain)."""
    ib_hcas: tuple[str, ...] = ()
    """InfiniBand HCAs used for GPU traffic, e.g. mlx5_0 ... mlx5_7."""
    nccl: Mapping[str, str] = field(default_factory=dict)
    """NCCL/network environment preset exported before the ranks start (NCCL_IB_HCA, ...; GLOO_SOCKET_IFNAME too:
    GPU ranks run gloo beside NCCL for CPU tensors, the asynchronous checkpoint's coordination among them)."""
    nvlink_gbytes_s: float = 150.0
    """Bus bandwidth of one GPU inside its NVLink domain, GB/s (nccl-tests' busbw of a large all-reduce; the
    planner's tensor-parallel and in-node data-parallel traffic). Default: a conservative NVLink figure."""
    ib_gbytes_s: float = 12.5
    """Bus bandwidth of one GPU across nodes, GB/s (its share of the InfiniBand/RoCE fabric: 400 Gb/s NDR
    per GPU is 50). Default: 100 Gb/s per GPU."""


@dataclass(frozen=True)
class Defaults:
    account: Optional[str] = None
    """Slurm account (--account)."""
    qos: Optional[str] = None
    """Slurm QOS (--qos)."""
    constraint: Optional[str] = None
    """Node features (--constraint)."""
    exclusive: bool = False
    """Ask for whole nodes (--exclusive)."""
    signal_seconds: int = 120
    """How long before the time limit the job is told to checkpoint (--signal=B:USR1@N)."""
    exclude: tuple[str, ...] = ()
    """Nodes no job may use (--exclude), e.g. the bad nodes `meshrun doctor` lists; `submit --exclude` adds to it.
    Checked by `check_node_names` where they are used (the script's render, `submit --exclude`)."""


def check_node_names(key: str, names: Sequence[str]) -> tuple[str, ...]:
    """Node names for --exclude, each checked, duplicates dropped (first order kept)."""
    for name in names:
        if not NODE_NAME.fullmatch(name):
            raise InputError(
                key, name, "list node names as Slurm shows them, e.g. n1,n7 (letters, digits, . _ -; no ranges)"
            )
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Container:
    runtime: Literal["pyxis", "apptainer"]
    """pyxis (srun --container-image) or apptainer (apptainer exec)."""
    image: str
    """Image reference (pyxis: registry#image:tag or a .sqsh file; apptainer: a .sif file)."""
    mounts: tuple[str, ...] = ()
    """SRC:DST bind mounts (shared storage must be mounted for the run dir)."""


@dataclass(frozen=True)
class Cost:
    gpu_hour: float = bounded(0.0, "a price per GPU-hour: a number, 0 or more", at_least=0)
    """What one allocated GPU-hour costs on this cluster (0: unpriced); `plan` prices a whole run with it."""
    currency: str = "USD"
    """The unit of gpu_hour, as printed (USD, EUR, credits, ...)."""


@dataclass(frozen=True)
class ClusterProfile:
    name: str
    """Profile name, as given to -c."""
    scheduler: Literal["slurm", "local"]
    """slurm, or local (this machine, no Slurm: ranks are local processes)."""
    paths: Paths
    """Where things live on the cluster."""
    ssh: Optional[Ssh] = None
    """How to reach the login node; unset when meshrun runs on the login node itself."""
    setup: tuple[str, ...] = ()
    """Shell lines run before the ranks start (module load, venv activation). Trusted: rendered verbatim."""
    python: str = "python3"
    """Python interpreter on the nodes (after the setup lines)."""
    partitions: tuple[Partition, ...] = ()
    """The partitions jobs may use."""
    interconnect: Interconnect = field(default_factory=Interconnect)
    """NVLink domain, InfiniBand HCAs and the NCCL preset."""
    defaults: Defaults = field(default_factory=Defaults)
    """Account, QOS, constraint, exclusivity and the pre-timeout signal."""
    container: Optional[Container] = None
    """Run the ranks inside a container."""
    description: str = ""
    """One line shown by `meshrun clusters`."""
    cost: Cost = field(default_factory=Cost)
    """The price of a GPU-hour, for `plan`'s estimate of what a run costs."""

    def __post_init__(self) -> None:
        if not CURRENCY.fullmatch(self.cost.currency):
            raise SchemaError("cost.currency", self.cost.currency, "a unit of 1-12 letters, e.g. USD or credits")
        if not PROFILE_NAME.fullmatch(self.name):
            raise SchemaError("name", self.name, "use letters, digits, '_' or '-' (at most 64)")
        for key in self.interconnect.nccl:
            if not ENV_KEY.fullmatch(key):
                raise SchemaError(
                    f"interconnect.nccl.{key}", key, "environment variable names match [A-Za-z_][A-Za-z0-9_]*"
                )
        names = [p.name for p in self.partitions]
        if len(set(names)) != len(names):
            raise SchemaError("partitions", names, "partition names must be unique")
        if sum(p.default for p in self.partitions) > 1:
            raise SchemaError("partitions", names, "mark at most one partition `default: true`")

    def partition(self, name: Optional[str]) -> Partition:
        """The named partition, else the default one (or the only one)."""
        if name is None:
            chosen = [p for p in self.partitions if p.default] or list(self.partitions[:1])
            if not chosen:
                raise InputError(
                    "resources.partition", None, f"cluster {self.name!r} lists no partitions; add one to its profile"
                )
            return chosen[0]
        for part in self.partitions:
            if part.name == name:
                return part
        valid = ", ".join(p.name for p in self.partitions)
        raise InputError(
            "resources.partition",
            name,
            f"no such partition on {self.name!r}{schema.closest(name, [p.name for p in self.partitions])}; "
            f"valid: {valid}",
        )


SHARED_DIRS_ENV = "MESHRUN_CLUSTERS"
"""Folders of profiles a team shares (a login node's /etc/meshrun/clusters, a project's own), ':'-separated."""


def user_dir() -> Path:
    return config_dir() / "clusters"


def shared_dirs(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The folders MESHRUN_CLUSTERS names, in its order (empty entries skipped)."""
    return [Path(part).expanduser() for part in environ.get(SHARED_DIRS_ENV, "").split(os.pathsep) if part]


def profile_files() -> dict[str, Path]:
    """Profile name -> file: the shipped ones, overridden by MESHRUN_CLUSTERS' folders (a later one wins), and
    those by the user's own folder."""
    found: dict[str, Path] = {}
    for folder in (SHIPPED_DIR, *shared_dirs(), user_dir()):
        if folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found[path.stem] = path
    return found


def load_profile_file(path: Path) -> ClusterProfile:
    """A profile's name is its file's name: a copy of h100-ndr.yaml saved as mycluster.yaml is
    "mycluster", so two profiles can never share a name and a job goes back to its own cluster."""
    doc = YamlDoc(path)
    data = doc.data
    stem = Path(path).stem
    if isinstance(data, dict):
        if data.get("name", stem) != stem:
            raise InputError(
                f"{path}: name",
                data["name"],
                f"a profile's name is its file name ({stem!r}); remove `name:` or rename the file",
            )
        data = {**data, "name": stem}
    try:
        return schema.load(ClusterProfile, data)
    except SchemaError as exc:
        raise doc.error(exc) from None


def is_profile_path(name_or_path: str) -> bool:
    """-c took a file (my.yaml, ./x/y) rather than a profile name."""
    return name_or_path.endswith((".yaml", ".yml")) or os.sep in name_or_path


def profile_path(name_or_path: str) -> Path:
    """The file behind -c: a path as given (absolute), or the named profile's file."""
    if is_profile_path(name_or_path):
        return Path(name_or_path).resolve()
    files = profile_files()
    if name_or_path not in files:
        raise InputError(
            "-c/--cluster",
            name_or_path,
            f"no such cluster{schema.closest(name_or_path, files)}; known: {', '.join(sorted(files))} "
            f"(add your own in {user_dir()})",
        )
    return files[name_or_path].resolve()


def load_profile(name_or_path: str) -> ClusterProfile:
    """A profile by name (shipped or the user's) or by path to a YAML file."""
    return load_profile_file(profile_path(name_or_path))
