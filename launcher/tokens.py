"""Token files and their record: the contract between `meshrun data`, the planner and the ranks.

Torch-free and stdlib-only (the planner reads it on a laptop). A token file `X` built by `meshrun data`
has a JSON record `X.json` beside it: its dtype, the vocabulary size, the end-of-text id, the tokenizer
file saved next to it and the held-out validation file. Files without a record are read as before:
bytes (vocab 256), uint16 unless the name ends in `.u32`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.schema import SchemaError
from launcher.spec import Data, JobSpec

BYTES_VOCAB = 256
"""The vocabulary of a token file without a record: one token per byte."""


def record_path(path: str | Path) -> Path:
    """Where the record of token file `path` lives: `path.json`."""
    return Path(str(path) + ".json")


@dataclass(frozen=True)
class TokenRecord:
    """What `X.json` says about token file X (the keys the ranks and the planner use)."""

    vocab_size: int = BYTES_VOCAB
    dtype: str = "uint16"
    eot_id: Optional[int] = None
    """The end-of-text token between documents; None for a bytes file built before records had one."""
    tokenizer: Optional[str] = None
    """The tokenizer file saved beside the token file (a name relative to its folder), if any."""
    val_path: Optional[str] = None
    """The held-out validation token file beside it (relative name), if the build wrote one."""


def read_record(path: str | Path) -> Optional[TokenRecord]:
    """The record of token file `path`; None when it has none. A record that is not JSON is bad input."""
    where = record_path(Path(path).expanduser())
    try:
        raw: Any = json.loads(where.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SchemaError(str(where), f"unreadable ({exc})", "rebuild the token file with `meshrun data`") from None
    if not isinstance(raw, dict):
        raise SchemaError(str(where), "not a JSON object", "rebuild the token file with `meshrun data`")
    known = {f.name for f in dataclasses.fields(TokenRecord)}
    return TokenRecord(**{k: v for k, v in raw.items() if k in known})


def training_files(data: Data) -> list[str]:
    """Every token file the ranks read for training, as the spec names them."""
    return [b.path for b in data.blend] if data.blend else [data.path]


def resolve_vocab(job: JobSpec, home: Optional[str] = None) -> JobSpec:
    """train.model.vocab_size 0 -> the tokenizer's, from the first training file's record (256 for a
    file without one). Unchanged when the spec gives a size, for a command job, and where the file is
    not visible (a laptop: the ranks resolve it when they start)."""
    if job.train is None or job.train.model.vocab_size:
        return job
    first = local_path(training_files(job.data)[0], home)
    if not first.is_file():
        return job
    record = read_record(first)
    vocab = record.vocab_size if record is not None else BYTES_VOCAB
    model = dataclasses.replace(job.train.model, vocab_size=vocab)
    return dataclasses.replace(job, train=dataclasses.replace(job.train, model=model))


def local_path(path: str, home: Optional[str] = None) -> Path:
    """A path of the spec as a file here: `~` is `home` (the cluster user's, as the planner knows it), or
    this user's when None."""
    if home is not None and (path == "~" or path.startswith("~/")):
        return Path(home + path[1:])
    return Path(path).expanduser()


def visible_here(path: Path) -> bool:
    """Whether this machine sees the filesystem `path` is on: its top folder exists (a login node sees
    /lustre, a laptop does not). A missing file is refused only where it could have been found."""
    return len(path.parts) > 1 and Path(*path.parts[:2]).exists()


def check_data_files(job: JobSpec, home: Optional[str] = None) -> None:
    """Every data file the spec names exists, where this machine sees its filesystem (the local cluster,
    a login node, the ranks themselves). Raises SchemaError naming the key, the path and the fix."""
    if job.command is not None:
        return
    keys = [(f"data.blend[{i}].path", b.path) for i, b in enumerate(job.data.blend)] or [("data.path", job.data.path)]
    if job.data.val_path:
        keys.append(("data.val_path", job.data.val_path))
    for key, path in keys:
        here = local_path(path, home)
        if visible_here(here) and not here.is_file():
            raise SchemaError(key, path, "no such token file: build it with `meshrun data` or fix the path")
