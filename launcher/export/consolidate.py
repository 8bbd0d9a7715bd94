"""Consolidate a sharded checkpoint into safetensors, for use outside meshrun.

    python -m meshrun.launcher.export.consolidate CHECKPOINT OUT [--format meshrun|hf] [--max-shard-size 5GB]

CHECKPOINT is a step folder (`ROOT/step-N`) or a checkpoint root, whose newest complete
step is exported; if retention deletes that step while it loads (a run still saving
with a small `checkpoint.keep`), the then-newest one is taken instead. Runs in one process on any machine
that can read the checkpoint (no GPU, no process group), whatever (dp, tp, pp) layout saved it.

Streamed: the names, shapes and dtypes come from the spec in the checkpoint's marker and DCP's metadata,
so every file's header is written first, then the tensors are read a few at a time (DCP loads a partial
state dict: only their bytes) and written as they arrive; the process holds at most
shardwriter.HOLD_BYTES of tensors (or one larger tensor), never the model. A checkpoint of the deepspeed
engine (the marker's job says `train.engine: deepspeed`) is consolidated by DeepSpeed's own code from
its save in `step-N/deepspeed/`, whatever ZeRO stage sharded it: that one is held whole, then written.

`meshrun` format: one file OUT, the GPT's own names, metadata (step, model config) in safetensors'
string map. `hf` format: a folder OUT for transformers' LlamaForCausalLM (launcher/contract/spec/hfnames.py): Hugging
Face names in `model.safetensors` or shards of at most --max-shard-size with their index, config.json,
and the tokenizer `meshrun data` saved beside the run's token file, when there is one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec import dsconfig, hfnames, schema
from meshrun.launcher.contract.spec.job import JobSpec, Model
from meshrun.launcher.export import shardwriter as sw

FORMATS = ("meshrun", "hf")
DEFAULT_SHARD = "5GB"
ATTEMPTS = 5
_STEP = re.compile(r"^step-(\d+)(\.tmp)?$")
DEEPSPEED_TAG = "deepspeed"
"""The deepspeed engine's own save inside a step folder: save_checkpoint(step_dir, tag=DEEPSPEED_TAG)."""


class OutputError(ValueError):
    """OUT cannot be written: names the path and the fix."""


class Vanished(ckptdir.CheckpointError):
    """The checkpoint lost its marker while it was read (retention deleted it)."""


def _complete(root: Path) -> str:
    return ", ".join(map(str, ckptdir.complete_steps(root))) or "none"


def missing_step(path: Path) -> ckptdir.CheckpointError:
    """Why `path` is no checkpoint to export, in the user's terms (a step number, the root)."""
    match = _STEP.match(path.name)
    if match is None:
        return ckptdir.CheckpointError(
            f"{path} is not a checkpoint: give a step folder (ROOT/step-N) or a checkpoint root"
        )
    step, root = int(match.group(1)), path.parent
    exists = ckptdir.step_dir(root, step).exists() or ckptdir.step_dir(root, step).with_suffix(".tmp").exists()
    state = (
        f"checkpoint step {step} under {root} is incomplete (an interrupted save)"
        if exists
        else f"no checkpoint step {step} under {root}"
    )
    return ckptdir.CheckpointError(f"{state}; complete steps: {_complete(root)}")


def choose(path: Path) -> tuple[Path, bool]:
    """The step folder to export and whether it was picked as the newest (so may be retried)."""
    path = Path(path)
    if (path / ckptdir.MARKER).is_file():
        return path, False
    if path.is_dir() and _STEP.match(path.name) is None:
        newest = ckptdir.latest(path)
        if newest is None:
            raise ckptdir.CheckpointError(f"no complete checkpoint under {path} yet")
        return newest, True
    raise missing_step(path)


@dataclass
class Source:
    """A complete checkpoint's model tensors, read on demand: names and shapes from the marker's spec,
    dtypes from DCP's metadata; `load` reads only the tensors asked for."""

    path: Path
    job: JobSpec
    step: int
    dtypes: dict[str, torch.dtype]
    """Every GPT tensor (its state dict's names, in model order) and its saved dtype."""
    _whole: dict[str, torch.Tensor] = field(default_factory=dict)
    """The deepspeed engine's consolidated model (DeepSpeed's code gathers it at once)."""

    @property
    def model(self) -> Model:
        return self.job.trainer.model

    def entries(self) -> list[sw.Entry]:
        """The tensors in meshrun naming, in model order."""
        shapes = hfnames.meshrun_shapes(self.model)
        return [sw.Entry(name, shapes[name], dtype, name) for name, dtype in self.dtypes.items()]

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        try:
            if self.job.trainer.engine == "deepspeed":
                if not self._whole:
                    like = {n: torch.empty(s, dtype=self.dtypes[n], device="meta") for n, s in self._shapes().items()}
                    self._whole = deepspeed_weights(self.path, self.job, like)
                return {name: self._whole[name] for name in names}
            shapes = self._shapes()
            state = {"model": {name: torch.empty(shapes[name], dtype=self.dtypes[name]) for name in names}}
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(self.path), no_dist=True)
            return state["model"]
        except Exception:
            if not (self.path / ckptdir.MARKER).is_file():  # retention unmarks before it deletes
                raise Vanished(
                    f"checkpoint {self.path} was deleted while it was read (retention: checkpoint.keep); "
                    f"complete steps now: {_complete(self.path.parent)}"
                ) from None
            raise

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return hfnames.meshrun_shapes(self.model)

    def metadata(self) -> dict[str, str]:
        return {
            "format": "meshrun-gpt",
            "step": str(self.step),
            "model": json.dumps(schema.to_plain(self.model), sort_keys=True),
        }


def open_source(path: Path) -> Source:
    """The checkpoint at `path` (complete), its spec and its tensors' dtypes; nothing loaded yet."""
    path = Path(path)
    if not (path / ckptdir.MARKER).is_file():
        raise missing_step(path)
    try:
        marker = ckptdir.read_marker(path)
    except FileNotFoundError:
        raise Vanished(f"checkpoint {path} was deleted while it was read (retention: checkpoint.keep)") from None
    job = schema.load(JobSpec, marker["job"])
    names = list(hfnames.meshrun_shapes(job.trainer.model))
    if job.trainer.engine == "deepspeed":  # DeepSpeed's consolidation gives the fp32 master weights
        return Source(path, job, int(marker["step"]), dict.fromkeys(names, torch.float32))
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [name for name in names if f"model.{name}" not in saved]
    if missing:
        raise ckptdir.CheckpointError(
            f"{path}: tensor {missing[0]} of train.model is not in the checkpoint; export it with the spec it was saved with"
        )
    dtypes = {name: saved[f"model.{name}"].properties.dtype for name in names}  # type: ignore[union-attr]
    return Source(path, job, int(marker["step"]), dtypes)


def consolidated_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The full model's tensors from a complete checkpoint, and metadata about them (all in memory: tests)."""
    source = open_source(path)
    return source.load(list(source.dtypes)), source.metadata()


def deepspeed_weights(path: Path, job: JobSpec, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full model from DeepSpeed's own save in `path/deepspeed/`, by DeepSpeed's own consolidation.

    ZeRO 1-3: the fp32 master weights gathered from every rank's shards (zero_to_fp32, as DeepSpeed's
    own script does); ZeRO-0 keeps whole weights in the model states file. The engine wraps the GPT
    itself, so the names are the GPT's; loading into `like` (strict) proves it and keeps the native
    export's names, shapes and dtypes.
    """
    folder = Path(path) / DEEPSPEED_TAG
    try:
        if dsconfig.zero_stage(job) == 0:
            # DeepSpeed's pickle holds its config and client state besides tensors: not weights_only.
            states = torch.load(folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
            saved = states["module"]
        else:
            # The consolidation is CPU work: no accelerator probing (a warning, or CUDA set up on a GPU
            # login node). DeepSpeed logs to stdout, where the export's one line of output goes.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            with contextlib.redirect_stdout(sys.stderr):
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                saved = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=DEEPSPEED_TAG)
    except ImportError as exc:
        raise ckptdir.CheckpointError(
            f"{path} was saved by the deepspeed engine and reading it needs DeepSpeed ({exc}); "
            "install it: pip install 'meshrun[deepspeed]'"
        ) from None
    missing, unexpected = set(like) - set(saved), set(saved) - set(like)
    if missing or unexpected:
        raise ckptdir.CheckpointError(
            f"{folder}: DeepSpeed's weights do not match train.model (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); export it with the spec it was trained with"
        )
    return {name: saved[name].to(like[name].dtype) for name in like}


def check_output(out: Path, fmt: str = "meshrun") -> Path:
    """OUT as an absolute path whose folder exists and is writable (checked before any loading): a file for
    the meshrun format; for hf a folder that is new, empty, or an earlier hf export (replaced)."""
    out = Path(os.path.abspath(out))
    if fmt == "meshrun" and out.is_dir():
        raise OutputError(f"{out}: is a directory; give a file name, e.g. {out / 'model.safetensors'}")
    if fmt == "hf" and not hfnames.replaceable_folder(out):
        raise OutputError(f"{out}: exists and is no earlier hf export; give a new folder name")
    if not out.parent.is_dir():
        raise OutputError(
            f"{out}: folder {out.parent} does not exist; create it (mkdir -p {out.parent}) or write elsewhere"
        )
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out}: folder {out.parent} is not writable for you; write elsewhere")
    return out


def write_meshrun(source: Source, out: Path) -> int:
    """OUT as one safetensors file in meshrun naming, streamed; written beside OUT, then renamed."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    entries = source.entries()
    try:
        sw.write_file(tmp, entries, source.load, source.metadata())
        os.replace(tmp, out)
    except OSError as exc:
        raise OutputError(f"{out}: cannot be written ({exc}); check the path and free space") from None
    finally:
        tmp.unlink(missing_ok=True)
    return len(entries)


def load_newest(path: Path) -> Source:
    """The chosen checkpoint; a newest-by-default one deleted before it was opened is chosen again."""
    for attempt in range(ATTEMPTS):
        chosen, retry = choose(path)
        try:
            return open_source(chosen)
        except ckptdir.CheckpointError:
            if not retry or attempt == ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")
