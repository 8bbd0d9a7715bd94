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
from typing import Any, Mapping, Optional

from meshrun.launcher.contract.spec.job import Data, JobSpec
from meshrun.launcher.contract.spec.schema import SchemaError

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


EMPTY = "the token file is empty; rebuild it (`meshrun data`) or name another file"


def torn(size: int, dtype: str) -> str:
    return f"{size} bytes is not a whole number of {dtype} tokens (cut short, or not a token file): {DATA_FIX}"


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


@dataclass(frozen=True)
class Sample:
    """What a data file's size and first SAMPLE_BYTES say, counted on this machine (`read_sample`) or by sh on the
    cluster (submit's preflight): `sample_problem` judges both the same way."""

    size: int
    width: int
    """Bytes per token id (`token_width`)."""
    has_nul: bool
    """A NUL byte among the sampled: token ids below 256 in uint16 have one in every other byte."""
    ascii_only: bool
    """The sampled bytes are printable ASCII and whitespace only."""
    largest: int
    """The largest token id in the sample."""
    utf8: bool = True
    """The sample decodes as UTF-8 (True where not tested: sh on the cluster)."""
    container: str = ""
    """What its first bytes say it is when a known container ("a zip archive"), else ''."""
    has_record: bool = False
    """A record (PATH.json) is beside it."""
    record_vocab: Optional[int] = None
    """The record's vocabulary, where it was read."""


def read_sample(here: Path, record: Optional[TokenRecord]) -> Sample:
    """The Sample of the token file at `here` (its first SAMPLE_BYTES read once)."""
    with open(here, "rb") as f:
        data = f.read(SAMPLE_BYTES)
    width = token_width(here, record)
    try:
        data.decode("utf-8")
        utf8 = True
    except UnicodeDecodeError as exc:
        utf8 = exc.start >= len(data) - 3  # a character cut by the sample's end is still text
    return Sample(
        size=here.stat().st_size,
        width=width,
        has_nul=b"\0" in data,
        ascii_only=ASCII_TEXT.issuperset(data),
        largest=largest_id(data, width),
        utf8=utf8,
        container=next((kind for magic, kind in MAGIC.items() if data.startswith(magic)), ""),
        has_record=record is not None,
        record_vocab=record.vocab_size if record else None,
    )


def is_text(sample: Sample) -> bool:
    """No NUL byte, and printable ASCII from ASCII_TEXT_MIN_BYTES or UTF-8 from TEXT_MIN_BYTES."""
    sampled = min(sample.size, SAMPLE_BYTES)
    if sample.has_nul:
        return False
    return (sampled >= ASCII_TEXT_MIN_BYTES and sample.ascii_only) or (sampled >= TEXT_MIN_BYTES and sample.utf8)


def sample_problem(sample: Sample, vocab: int) -> Optional[str]:
    """Why the file is not one of token ids of the model's `vocab` (0: the tokenizer's), said after its key and path;
    None when its sample passes (the ranks check every id again: meshrun.launcher.data.dataset)."""
    if sample.container:
        return f"is {sample.container}, not token ids: unpack it, then {DATA_FIX}"
    if is_text(sample):
        return f"is text, not token ids; {TEXT_FIX}"
    if sample.size == 0:
        return EMPTY
    if sample.size % sample.width:
        return torn(sample.size, "uint32" if sample.width == 4 else "uint16")
    top = sample.largest
    if sample.record_vocab is not None and top >= sample.record_vocab:
        return f"holds token id {top}, beyond the {sample.record_vocab} ids its record says: {DATA_FIX}"
    if not sample.has_record and not vocab and top >= BYTES_VOCAB:
        return (
            f"holds token id {top}, but a file without a record is read as bytes (ids below {BYTES_VOCAB}): give "
            f"train.model.vocab_size (its tokenizer's), or {DATA_FIX}"
        )
    if vocab and top >= vocab:
        return (
            f"token id {top} (in its first MiB) is not below train.model.vocab_size={vocab}; raise "
            f"train.model.vocab_size to at least {top + 1} (0 takes the tokenizer's), or rebuild the data "
            f"with a tokenizer of at most {vocab} ids"
        )
    return None


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


def check_enough_windows(job: JobSpec, records: Mapping[Path, Optional[TokenRecord]], home: Optional[str]) -> None:
    """The training files hold one global batch of sequences at least, counted from their sizes as the ranks count
    them (meshrun.launcher.data.dataset), where this machine sees them all (`records`: each visible file's record)."""
    if job.train is None:
        return
    data, window = job.data, job.train.model.seq_len + 1
    main = local_path(data.path, home)
    main_record = records.get(main)
    separate = bool(data.val_path) or bool(main_record and main_record.val_path)
    tokens = windows = 0
    for path in training_files(data):
        here = local_path(path, home)
        if here not in records:
            return
        count = here.stat().st_size // token_width(here, records[here])
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
        problem = sample_problem(read_sample(here, record), job.train.model.vocab_size if job.train else 0)
        if problem:
            raise SchemaError(key, path, problem)
    check_enough_windows(job, {here: record for _, _, here, record in found}, home)
