"""Token files and their record: the contract between `meshrun data`, the planner and the ranks.

Torch-free and stdlib-only (the planner reads it on a laptop). A token file `X` built by `meshrun data`
has a JSON record `X.json` beside it: its dtype, the vocabulary size, the end-of-text id, the tokenizer
file saved next to it and the held-out validation file. Files without a record are read as before:
bytes (vocab 256), uint16 unless the name ends in `.u32`.
"""

from __future__ import annotations

import array
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from launcher.contract.schema import SchemaError
from launcher.contract.spec import Data, JobSpec

TOKEN_WIDTHS = {"uint16": 2, "uint32": 4}
"""The dtypes a token file may hold, and their bytes."""
BYTES_VOCAB = 256
"""The vocabulary of a token file without a record: one token per byte."""


SAMPLE_BYTES = 1 << 20
"""How much of each token file is read at submit and rank start to tell it is one (ids within its vocabulary)."""
TEXT_MIN_BYTES = 4096
"""From this size a file without a NUL byte that is valid UTF-8 is text (2048 ids of a real tokenizer's file lack a
NUL with odds of about 1 in 10^7)."""
ASCII_TEXT_MIN_BYTES = 64
"""From this size a file of printable ASCII and whitespace only is text, however short (32 ids of a real tokenizer's
file are all such bytes with odds below 1 in 10^4; a file of byte ids always has NULs)."""
ASCII_TEXT = frozenset(b"\t\n\r" + bytes(range(0x20, 0x7F)))
TEXT_FIX = "name it .txt, .md or .jsonl and make token ids of it with `meshrun data FILE --out OUT.u16`"
"""How a text file given as data becomes token ids (`meshrun data` knows a file's format by its suffix)."""
DATA_FIX = "build a token file from your texts with `meshrun data TEXTS --out OUT.u16`, or fix the path"


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
    tokenizer_sha256: Optional[str] = None
    """SHA-256 of the tokenizer file: two token files are compatible when this and vocab_size agree."""


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


def data_keys(data: Data) -> list[tuple[str, str]]:
    """(spec key, path) of every token file the ranks read: the training files, then where validation comes
    from (data.val_path, else data.path, which a blend reads only for its validation)."""
    keys = [(f"data.blend[{i}].path", b.path) for i, b in enumerate(data.blend)] or [("data.path", data.path)]
    if data.val_path:
        keys.append(("data.val_path", data.val_path))
    elif data.blend:
        keys.append(("data.path", data.path))
    return keys


def record_or_bytes(path: Path) -> TokenRecord:
    """The file's record; a file without one is bytes (vocab 256)."""
    return read_record(path) or TokenRecord()


def check_blend(data: Data) -> None:
    """Every blend weight is a positive number (a pure check: no file is read)."""
    for i, source in enumerate(data.blend):
        if not source.weight > 0:  # also refuses NaN
            raise SchemaError(
                f"data.blend[{i}].weight", source.weight, "give a positive weight (its share relative to the others)"
            )


def check_same_tokenizer(data: Data, home: Optional[str] = None) -> None:
    """The visible files the ranks read share one vocabulary and tokenizer: ids of one mean nothing in another."""
    first: Optional[tuple[str, str, TokenRecord]] = None
    for key, path in data_keys(data):
        here = local_path(path, home)
        if not here.is_file():
            continue
        record = record_or_bytes(here)
        if first is None:
            first = (key, path, record)
            continue
        key0, path0, record0 = first
        if (record.vocab_size, record.tokenizer_sha256) != (record0.vocab_size, record0.tokenizer_sha256):
            raise SchemaError(
                key,
                path,
                f"made with another tokenizer than {key0} ({path0}): vocab {record.vocab_size} vs "
                f"{record0.vocab_size}{'' if record.vocab_size != record0.vocab_size else ', other tokenizer file'}; "
                "rebuild them with one tokenizer (`meshrun data --tokenizer FILE.tokenizer.json`)",
            )


def resolve_vocab(job: JobSpec, home: Optional[str] = None) -> JobSpec:
    """train.model.vocab_size 0 -> the tokenizer's, from the first training file's record (256 for a
    file without one; a blend's files must agree, see check_same_tokenizer). Unchanged when the spec
    gives a size, for a command job, and where the file is not visible (a laptop: the ranks resolve it
    when they start)."""
    if job.train is None or job.train.model.vocab_size:
        return job
    first = local_path(training_files(job.data)[0], home)
    if not first.is_file():
        return job
    vocab = record_or_bytes(first).vocab_size
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


def token_dtype(path: str | Path, record: Optional[TokenRecord]) -> str:
    """A token file's dtype: its record's (meshrun data), else uint32 for a name ending in `.u32`, else uint16."""
    if record is not None:
        if record.dtype not in TOKEN_WIDTHS:
            raise SchemaError(f"{path}.json dtype", record.dtype, f"expected one of {', '.join(TOKEN_WIDTHS)}")
        return record.dtype
    return "uint32" if str(path).endswith(".u32") else "uint16"


def token_width(path: str | Path, record: Optional[TokenRecord]) -> int:
    """Bytes per token (`token_dtype`)."""
    return TOKEN_WIDTHS[token_dtype(path, record)]


def torn_file(key: str, path: str, size: int, dtype: str) -> SchemaError:
    return SchemaError(
        key, path, f"{size} bytes is not a whole number of {dtype} tokens (cut short, or not a token file): {DATA_FIX}"
    )


def empty_file(key: str, path: str) -> SchemaError:
    return SchemaError(key, path, "the token file is empty; rebuild it (`meshrun data`) or name another file")


def largest_id(data: bytes, width: int) -> int:
    """The largest token id in `data` (little-endian, as numpy writes them on every machine meshrun runs on)."""
    ids = array.array("I" if width == 4 else "H")
    if ids.itemsize != width:  # a platform whose C int is not 4 bytes: fall back to reading them one by one
        return max((int.from_bytes(data[i : i + width], "little") for i in range(0, len(data), width)), default=0)
    ids.frombytes(data[: len(data) - len(data) % width])
    if sys.byteorder != "little":
        ids.byteswap()
    return max(ids, default=0)


MAGIC = {b"PAR1": "a Parquet file", b"\x1f\x8b": "gzip-compressed", b"PK\x03\x04": "a zip archive"}


def file_kind(sample: bytes) -> str:
    """What the first bytes of a data file say it is when that is not token ids ('' when it may be): text (no NUL
    byte, and printable ASCII only, or valid UTF-8 over TEXT_MIN_BYTES: token ids below 256 in uint16 have a NUL in
    every other byte, larger ones are neither for long), or a known container."""
    for magic, kind in MAGIC.items():
        if sample.startswith(magic):
            return kind
    if b"\0" in sample:
        return ""
    if len(sample) >= ASCII_TEXT_MIN_BYTES and ASCII_TEXT.issuperset(sample):
        return "text"
    if len(sample) < TEXT_MIN_BYTES:
        return ""
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(sample) - 3:  # a character cut by the sample's end is still text
            return ""
    return "text"


def check_token_sample(key: str, path: str, here: Path, record: Optional[TokenRecord], vocab: int) -> None:
    """The file is one of token ids: not text or a container, a whole number of ids, and in its first SAMPLE_BYTES
    every id within its own vocabulary (its record's, else the bytes' 256) and the model's `vocab`: such a file
    given as data is refused at submit, before it queues (the ranks check every id again: launcher.data.dataset)."""
    with open(here, "rb") as f:
        sample = f.read(SAMPLE_BYTES)
    kind = file_kind(sample)
    if kind == "text":
        raise SchemaError(key, path, f"is text, not token ids; {TEXT_FIX}")
    if kind:
        raise SchemaError(key, path, f"is {kind}, not token ids: unpack it, then {DATA_FIX}")
    dtype, size = token_dtype(here, record), here.stat().st_size
    width = TOKEN_WIDTHS[dtype]
    if size == 0:
        raise empty_file(key, path)
    if size % width:
        raise torn_file(key, path, size, dtype)
    top = largest_id(sample, width)
    if record and top >= record.vocab_size:
        raise SchemaError(
            key, path, f"holds token id {top}, beyond the {record.vocab_size} ids its record says: {DATA_FIX}"
        )
    if not record and not vocab and top >= BYTES_VOCAB:
        raise SchemaError(
            key,
            path,
            f"holds token id {top}, but a file without a record is read as bytes (ids below {BYTES_VOCAB}): give "
            f"train.model.vocab_size (its tokenizer's), or {DATA_FIX}",
        )
    if vocab and top >= vocab:
        raise SchemaError(
            key,
            path,
            f"token id {top} (in its first MiB) is not below train.model.vocab_size={vocab}; raise "
            f"train.model.vocab_size to at least {top + 1} (0 takes the tokenizer's), or rebuild the data "
            f"with a tokenizer of at most {vocab} ids",
        )


def split_counts(n_tokens: int, fraction: float) -> tuple[int, int]:
    """(training tokens, held-out tail tokens) of a token file whose tail `fraction` validates."""
    n_val = int(n_tokens * fraction)
    return n_tokens - n_val, n_val


def too_few_windows(key: str, path: str, tokens: int, have: int, window: int, global_batch: int) -> SchemaError:
    """The error of a training split smaller than one global batch (every step would repeat the same sequences)."""
    return SchemaError(
        key,
        path,
        f"{tokens} tokens give {have} training sequences of seq_len+1={window} tokens (after holding out "
        f"data.val_fraction for validation), fewer than one global batch of {global_batch}; use a bigger token "
        "file, or a smaller train.global_batch or train.model.seq_len",
    )


def check_enough_windows(job: JobSpec, home: Optional[str] = None) -> None:
    """The training files hold one global batch of sequences at least, counted from their sizes as the ranks count
    them (launcher.data.dataset), where this machine sees them all."""
    if job.train is None:
        return
    data, window = job.data, job.train.model.seq_len + 1
    main = local_path(data.path, home)
    main_record = read_record(main) if main.is_file() else None
    separate = bool(data.val_path) or bool(main_record and main_record.val_path)
    tokens = windows = 0
    for path in training_files(data):
        here = local_path(path, home)
        if not here.is_file():
            return
        count = here.stat().st_size // token_width(here, read_record(here))
        tokens += count
        train = count if separate or here != main else split_counts(count, data.val_fraction)[0]
        windows += train // window
    if windows < job.train.global_batch:
        key = "data.blend[0].path" if data.blend else "data.path"
        raise too_few_windows(key, training_files(data)[0], tokens, windows, window, job.train.global_batch)


def check_data_files(job: JobSpec, home: Optional[str] = None) -> None:
    """Every data file the spec names exists, where this machine sees its filesystem (the local cluster,
    a login node, the ranks themselves), the files share one tokenizer, each holds token ids of the model's
    vocabulary, and together one global batch at least. Raises SchemaError naming the key, the path and the fix."""
    if job.command is not None:
        return
    check_blend(job.data)
    found: list[tuple[str, str, Path, Optional[TokenRecord]]] = []
    for key, path in data_keys(job.data):
        here = local_path(path, home)
        if visible_here(here) and not here.is_file():
            raise SchemaError(key, path, "no token file there; build it with `meshrun data` or fix the path")
        record = read_record(here) if here.is_file() else None
        if here.is_file():
            found.append((key, path, here, record))
        if (
            key == "data.path"
            and not job.data.val_path
            and record
            and record.val_path
            and not (here.parent / record.val_path).is_file()
        ):
            raise SchemaError(
                key,
                path,
                f"its record names held-out documents {record.val_path} beside it, which are missing; "
                "copy them along or rebuild the token file with `meshrun data`",
            )
    check_same_tokenizer(job.data, home)  # before the ids: ids of another tokenizer are the deeper mistake
    for key, path, here, record in found:
        check_token_sample(key, path, here, record, job.train.model.vocab_size if job.train else 0)
    check_enough_windows(job, home)
