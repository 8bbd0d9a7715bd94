"""Weights from outside a run (train.init_from): read a safetensors file's names and shapes without torch.

Torch-free and stdlib-only, so the planner can refuse a file that does not fit before anything touches
a cluster. A safetensors file starts with an 8-byte little-endian header length, then that many bytes of
JSON: {name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}. train.init_from is such a file
in meshrun's naming (`meshrun export`) or Hugging Face Llama's, or a Hugging Face export folder
(`model.safetensors`, or shards listed by `model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from meshrun.launcher.contract.spec import hfnames
from meshrun.launcher.contract.spec.job import JobSpec, Model
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.contract.spec.tokens import local_path, resolve_vocab, visible_here

HEADER_LIMIT = 100 << 20
"""The largest header accepted (safetensors' own limit): a bigger length means the file is no safetensors."""
INDEX = "model.safetensors.index.json"
"""Hugging Face's list of a sharded export's files (weight_map: tensor name -> file name)."""
SINGLE = "model.safetensors"
KEY = "train.init_from"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    dtype: str
    """safetensors' dtype name: F32, BF16, F16..."""
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of safetensors file `path`, in file order; an unreadable or damaged file is bad input."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(8)
            (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (None,)
            if length is None or length > HEADER_LIMIT:
                raise ValueError("no safetensors header")
            header: Any = json.loads(handle.read(length))
    except (OSError, ValueError) as exc:
        raise SchemaError(
            KEY, str(path), f"not a readable safetensors file ({exc}); give one `meshrun export` wrote"
        ) from None
    if not isinstance(header, dict):
        raise SchemaError(KEY, str(path), "its safetensors header is not a JSON object; give an intact file")
    return {
        name: TensorInfo(str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
        for name, entry in header.items()
        if name != "__metadata__"
    }


def weight_files(path: Path) -> list[Path]:
    """The safetensors files train.init_from names: itself, or an export folder's single file or shards."""
    if not path.is_dir():
        return [path]
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            return [path / name for name in dict.fromkeys(weight_map.values())]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SchemaError(KEY, str(path / INDEX), f"unreadable index ({exc}); export the folder again") from None
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    raise SchemaError(
        KEY, str(path), f"a folder without {SINGLE} or {INDEX}; give a .safetensors file or an export folder"
    )


def read_tensors(path: Path) -> dict[str, TensorInfo]:
    """Every tensor train.init_from holds, over all its files."""
    found: dict[str, TensorInfo] = {}
    for file in weight_files(path):
        found.update(read_header(file))
    return found


def expected(cfg: Model, hf: bool) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors a file in this naming must hold for model `cfg`, and those it may hold besides (a tied
    head's own copy)."""
    if hf:
        shapes = hfnames.hf_shapes(cfg)
        return shapes, {hfnames.HF_HEAD} if cfg.tie_embeddings else set()
    shapes = hfnames.meshrun_shapes(cfg)
    if cfg.tie_embeddings:
        del shapes[hfnames.HEAD]
        return shapes, {hfnames.HEAD}
    return shapes, set()


def mismatch(cfg: Model, found: dict[str, TensorInfo]) -> Optional[str]:
    """What is wrong with `found` for model `cfg`, first in model order (None when it fits)."""
    hf = hfnames.is_hf(list(found))
    shapes, optional = expected(cfg, hf)
    naming = "Hugging Face Llama" if hf else "meshrun"
    for name, shape in shapes.items():
        if name not in found:
            return f"tensor {name} is missing ({naming} naming; train.model needs it with shape {list(shape)})"
        if found[name].shape != shape:
            return f"tensor {name} has shape {list(found[name].shape)} in the file, train.model needs {list(shape)}"
    extra = [name for name in found if name not in shapes and name not in optional]
    if extra:
        return f"tensor {extra[0]} is not in train.model ({len(extra)} extra tensors; {naming} naming)"
    head = (cfg.vocab_size, cfg.d_model)
    for name in sorted(optional & set(found)):
        if found[name].shape != head:
            return f"tensor {name} has shape {list(found[name].shape)} in the file, train.model needs {list(head)}"
    return None


def check_shapes(cfg: Model, path: Path) -> None:
    """The init file holds exactly the tensors of model `cfg`, with its shapes."""
    problem = mismatch(cfg, read_tensors(path))
    if problem:
        raise SchemaError(KEY, str(path), f"{problem}; give weights of this model, or change train.model to match")


def check_init_from(job: JobSpec, home: Optional[str] = None) -> None:
    """train.init_from names a file (or export folder) that exists and fits the model, where this machine
    sees its filesystem."""
    path = job.train.init_from if job.train is not None else None
    if not path or not visible_here(local_path(path, home)):
        return
    here = local_path(path, home)
    if not here.exists():
        raise SchemaError(KEY, path, "no such file: give a .safetensors file or folder (`meshrun export` writes one)")
    train = resolve_vocab(job, home).train
    assert train is not None
    if train.model.vocab_size:  # 0: the token file is not visible here either; the ranks check it
        check_shapes(train.model, here)
