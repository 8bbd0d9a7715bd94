"""Build a token file from text already on this machine: what `meshrun data` runs.

Torch-free, so it runs anywhere (a login node, a laptop) without the ML stack; Hugging Face `tokenizers`
is imported only for a BPE or a user's tokenizer.json. The default corpus is the Python standard
library's own .py sources: every machine that runs meshrun has them, they are a few tens of MB of real
text, and needing no download keeps tests and examples hermetic.

Output, for `--out X`: the token file X (uint16 little-endian up to 65,536 ids, else uint32), each
document followed by the end-of-text token; with `val_fraction` > 0 the held-out documents in a second
token file beside it (`X.val` before X's suffix: `stdlib.val.u16`); the tokenizer file beside it
(`X.tokenizer.json`, not for bytes); and a JSON record `X.json` (launcher/contract/spec/tokens.py) naming all three.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Sequence, TextIO

from meshrun.launcher.contract.private import make_private_dir, private_umask
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.contract.spec.tokens import record_path
from meshrun.launcher.data.textsources import Inputs, Reader, Tally
from meshrun.launcher.data.tokenizer import (
    BytesTokenizer,
    Tokenizer,
    check_kind,
    dtype_for,
    load_tokenizer_file,
    train_bpe,
)

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
"""The default corpus's cap (the stdlib's .py, when no input is given): plenty for the reference model,
builds in seconds. A user's own inputs are read whole unless --max-mb says otherwise."""
BATCH_BYTES = 4 * 1024 * 1024
"""Text handed to the tokenizer at a time: big enough for its threads, small enough to stream."""


@dataclass(frozen=True)
class BuildOptions:
    """How `meshrun data` turns documents into tokens."""

    tokenizer: str = "bytes"
    """`bytes`, `bpe` (trained here on the corpus) or the path of a tokenizer.json."""
    vocab: Optional[int] = None
    """The BPE's vocabulary size (required for bpe; checked against a tokenizer.json)."""
    eot: Optional[str] = None
    """A tokenizer.json's end-of-text token (default: the first of tokenizer.EOT_NAMES it has)."""
    val_fraction: float = 0.0
    """Documents held out for validation (each with this probability, by a seeded hash of its text)."""
    seed: int = 0
    """Seed of the held-out choice."""
    max_bytes: Optional[int] = None
    """Text read at most, in whole documents (None: every document of the inputs)."""
    progress: Optional[TextIO] = None
    """Where the progress line goes (a terminal), or None for none."""


@dataclass(frozen=True)
class CorpusStats:
    path: str
    """The token file written."""
    tokens: int
    """Training tokens in the file (end-of-text tokens included)."""
    sources: int
    """Documents read (each whole), training and held-out."""
    sha256: str
    """SHA-256 of the token file's bytes."""
    dtype: str = "uint16"
    """Token dtype, little-endian."""
    vocab_size: int = 256
    eot_id: int = 0
    documents: int = 0
    """Training documents."""
    val_tokens: int = 0
    val_documents: int = 0
    seconds: float = 0.0
    """Time spent reading and encoding (training a BPE included)."""
    files: dict[str, str] = field(default_factory=dict)
    """What went beside the token file: tokenizer / val_path -> file name."""
    text_bytes: int = 0
    """Text read, in bytes."""
    max_bytes: Optional[int] = None
    """The cap the read ran under (None: none)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """What the read passed over, counted (textsources.Tally.counts)."""
    skipped_line: str = ""
    """The same in words, for the summary ("" when nothing was skipped)."""


def default_roots() -> list[Path]:
    """The standard library of the running interpreter."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def default_inputs(roots: Optional[Sequence[Path]] = None) -> Inputs:
    """The standard library's .py sources when no roots are given (folders read as in any build otherwise)."""
    if roots is None:
        return Inputs(tuple(str(r) for r in default_roots()), suffixes=(".py",))
    return Inputs(tuple(str(r) for r in roots))


def held_out(doc: bytes, fraction: float, seed: int) -> bool:
    """Whether a document goes to validation: a seeded hash of its text, so a document (and every copy of it)
    lands in the same split whatever else is in the corpus."""
    if fraction <= 0.0:
        return False
    digest = hashlib.blake2b(doc, digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def make_tokenizer(inputs: Inputs, options: BuildOptions) -> Tokenizer:
    if options.tokenizer == "bytes":
        return BytesTokenizer()
    if options.tokenizer == "bpe":
        assert options.vocab is not None  # check_kind refused bpe without a vocab
        return train_bpe(Reader(inputs, options.max_bytes).documents(), options.vocab)
    return load_tokenizer_file(Path(options.tokenizer).expanduser(), options.vocab, options.eot)


def val_file(out: Path) -> Path:
    """Where the held-out documents of token file `out` go: `name.val.suffix` beside it."""
    return out.with_name(f"{out.stem}.val{out.suffix}") if out.suffix else out.with_name(out.name + ".val")


def tokenizer_file(out: Path) -> Path:
    return out.with_name(out.name + ".tokenizer.json")


class Progress:
    """One line on a terminal, redrawn at most 5 times a second: tokens, documents, tokens/s."""

    def __init__(self, stream: Optional[TextIO]) -> None:
        self.stream, self.start, self.shown = stream, time.perf_counter(), 0.0

    def update(self, tokens: int, documents: int, final: bool = False) -> None:
        now = time.perf_counter()
        if self.stream is None or (not final and now - self.shown < 0.2):
            return
        self.shown = now
        rate = tokens / max(now - self.start, 1e-9)
        self.stream.write(f"\rmeshrun data: {tokens:,} tokens, {documents:,} documents, {rate / 1e6:.2f}M tokens/s")
        self.stream.write("\n" if final else "")
        self.stream.flush()


class TokenWriter:
    """Appends documents' ids, each followed by end of text, to a token file; SHA-256 as it goes."""

    def __init__(self, fh: BinaryIO, dtype: str, eot_id: int) -> None:
        self.fh, self.eot_id, self.digest = fh, eot_id, hashlib.sha256()
        self.code = "H" if dtype == "uint16" else "I"
        self.tokens = self.documents = 0

    def add(self, ids: Sequence[int]) -> None:
        out = array(self.code, ids)
        out.append(self.eot_id)
        if sys.byteorder != "little":
            out.byteswap()
        data = out.tobytes()
        self.digest.update(data)
        self.fh.write(data)
        self.tokens += len(out)
        self.documents += 1


def _batches(documents: Iterator[bytes]) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_into(
    documents: Iterator[bytes], tokenizer: Tokenizer, train: TokenWriter, val: TokenWriter, options: BuildOptions
) -> None:
    """Encode batch by batch, each batch's encoding (tokenizers' threads, without the GIL) overlapping the
    reading of the next and the writing of the one before."""
    progress = Progress(options.progress)

    def write(batch: list[bytes], encoded: Future[Sequence[Sequence[int]]]) -> None:
        for doc, ids in zip(batch, encoded.result()):
            (val if held_out(doc, options.val_fraction, options.seed) else train).add(ids)
        progress.update(train.tokens + val.tokens, train.documents + val.documents)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshrun-encode") as pool:
        pending: Optional[tuple[list[bytes], Future[Sequence[Sequence[int]]]]] = None
        for batch in _batches(documents):
            encoding = pool.submit(tokenizer.encode_batch, batch)
            if pending is not None:
                write(*pending)
            pending = (batch, encoding)
        if pending is not None:
            write(*pending)
    progress.update(train.tokens + val.tokens, train.documents + val.documents, final=True)


def build_corpus(
    out: Path, roots: Optional[Sequence[Path]] = None, max_bytes: Optional[int] = None, **options: object
) -> CorpusStats:
    """Write a token file to `out` (and `out.json`) from the text under `roots` (default: the stdlib's .py).

    Deterministic: the same inputs and options give the same files, byte for byte. `max_bytes` caps the
    text read, in whole documents (default: DEFAULT_MAX_BYTES for the stdlib, none for `roots`). `options`
    are BuildOptions' fields (tokenizer, vocab, val_fraction, seed, ...).
    """
    cap = default_cap(roots is None, max_bytes)
    return build(Path(out), default_inputs(roots), BuildOptions(max_bytes=cap, **options))  # type: ignore[arg-type]


def default_cap(default_corpus: bool, max_bytes: Optional[int]) -> Optional[int]:
    """The cap a read runs under: the one given, else the default corpus's; a user's inputs are read whole."""
    if max_bytes is not None:
        return max_bytes
    return DEFAULT_MAX_BYTES if default_corpus else None


def build(out: Path, inputs: Inputs, options: BuildOptions) -> CorpusStats:
    """Tokenize `inputs` into token file `out`, the held-out documents, the tokenizer and the record."""
    check_options(options)
    out = out.expanduser()
    make_private_dir(out.parent, keep_existing=True)  # only the folders it creates: 0700
    started = time.perf_counter()
    tokenizer = make_tokenizer(inputs, options)
    dtype = dtype_for(tokenizer.vocab_size)
    targets = {"train": out, "val": val_file(out)}
    tmps = {k: p.with_name(f"{p.name}.tmp.{os.getpid()}") for k, p in targets.items()}
    try:
        with open(tmps["train"], "wb") as t_fh, open(tmps["val"], "wb") as v_fh:
            train, val = TokenWriter(t_fh, dtype, tokenizer.eot_id), TokenWriter(v_fh, dtype, tokenizer.eot_id)
            reader = Reader(inputs, options.max_bytes)
            encode_into(reader.documents(), tokenizer, train, val, options)
            _sync(t_fh, v_fh)
        check_counts(inputs, options, train, val)
        files = _commit(out, tmps, targets, tokenizer, has_val=val.documents > 0)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    stats = CorpusStats(
        path=str(out),
        tokens=train.tokens,
        sources=train.documents + val.documents,
        sha256=train.digest.hexdigest(),
        dtype=dtype,
        vocab_size=tokenizer.vocab_size,
        eot_id=tokenizer.eot_id,
        documents=train.documents,
        val_tokens=val.tokens,
        val_documents=val.documents,
        seconds=time.perf_counter() - started,
        files=files,
        **read_stats(reader.tally, options.max_bytes),
    )
    write_records(out, stats, inputs, val.digest.hexdigest())
    return stats


def read_stats(tally: Tally, max_bytes: Optional[int]) -> dict[str, Any]:
    """CorpusStats' fields about the read: text read, the cap, and what was passed over."""
    return {
        "text_bytes": tally.bytes_read,
        "max_bytes": max_bytes,
        "skipped": tally.counts(),
        "skipped_line": tally.describe(max_bytes),
    }


def check_options(options: BuildOptions) -> None:
    if options.max_bytes is not None and options.max_bytes <= 0:
        raise SchemaError("--max-mb", options.max_bytes / 1e6, "give a positive size, e.g. 16")
    if not 0.0 <= options.val_fraction < 1.0:
        raise SchemaError("--val-fraction", options.val_fraction, "give a fraction in [0, 1), e.g. 0.05")
    check_kind(options.tokenizer, options.vocab)


def check_counts(inputs: Inputs, options: BuildOptions, train: TokenWriter, val: TokenWriter) -> None:
    shown = ", ".join(inputs.paths)
    if train.documents + val.documents == 0:
        raise SchemaError(
            "INPUT", shown, f"no {'/'.join(inputs.suffixes)} text found; give a folder, file or glob of text files"
        )
    if train.documents == 0:
        raise SchemaError(
            "--val-fraction",
            options.val_fraction,
            f"all {val.documents} document(s) were held out for validation; lower it or give more documents",
        )


def _sync(*handles: BinaryIO) -> None:
    for fh in handles:
        fh.flush()
        os.fsync(fh.fileno())


def _commit(
    out: Path, tmps: dict[str, Path], targets: dict[str, Path], tokenizer: Tokenizer, has_val: bool
) -> dict[str, str]:
    """Move the finished files into place (readers see old files or whole new ones); returns the side files."""
    files: dict[str, str] = {}
    if has_val:
        os.replace(tmps["val"], targets["val"])
        files["val_path"] = targets["val"].name
    else:  # no document fell into the held-out split: validation takes the tail (data.val_fraction)
        targets["val"].unlink(missing_ok=True)
        record_path(targets["val"]).unlink(missing_ok=True)
    saved = tokenizer.save(tokenizer_file(out))
    if saved is not None:
        files["tokenizer"] = saved.name
    os.replace(tmps["train"], out)
    return files


def write_records(out: Path, stats: CorpusStats, inputs: Inputs, val_sha: str) -> None:
    """`out.json` (and the held-out file's own record, so that file is a token file in its own right)."""
    common = {
        "dtype": stats.dtype,
        "vocab_size": stats.vocab_size,
        "eot_id": stats.eot_id,
        "tokenizer": stats.files.get("tokenizer"),
        "tokenizer_sha256": _sha_of(out.parent, stats.files.get("tokenizer")),
        "inputs": list(inputs.paths),  # the sidecar travels with the file: no absolute output path in it
    }
    meta = {k: v for k, v in asdict(stats).items() if k not in ("path", "files", "seconds", "skipped_line")}
    _write_json(record_path(out), {**meta, **common, "val_path": stats.files.get("val_path")})
    if "val_path" in stats.files:
        val = {"tokens": stats.val_tokens, "documents": stats.val_documents, "sha256": val_sha}
        _write_json(record_path(out.with_name(stats.files["val_path"])), {**common, **val, "val_path": None})


def _sha_of(folder: Path, name: Optional[str]) -> Optional[str]:
    return hashlib.sha256((folder / name).read_bytes()).hexdigest() if name else None


def _write_json(path: Path, data: dict) -> None:
    import json

    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def parse_args(argv: Sequence[str]) -> tuple[Path, Inputs, BuildOptions]:
    import argparse

    p = argparse.ArgumentParser(prog="python -m meshrun.launcher.data.corpus", description="what `meshrun data` runs")
    p.add_argument("out", type=Path)
    p.add_argument("inputs", nargs="*", help="files, folders or globs (default: the stdlib's .py sources)")
    p.add_argument("--max-bytes", type=int, default=None, help="whole documents up to this much text")
    p.add_argument("--tokenizer", default="bytes")
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--eot", default=None)
    p.add_argument("--field", default="text")
    p.add_argument("--val-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    inputs = default_inputs([Path(i) for i in args.inputs] if args.inputs else None)
    inputs = Inputs(inputs.paths, inputs.suffixes, field=args.field)
    on_tty = sys.stderr if sys.stderr.isatty() else None
    cap = default_cap(not args.inputs, args.max_bytes)
    options = BuildOptions(args.tokenizer, args.vocab, args.eot, args.val_fraction, args.seed, cap, progress=on_tty)
    return args.out, inputs, options


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m meshrun.launcher.data.corpus OUT [INPUT...] [--tokenizer ...]`: what `meshrun data` runs (the caller's
    side imports nothing of launcher beyond its torch-free contract)."""
    private_umask()  # the token files are the user's own text, encoded
    out, inputs, options = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        stats = build(out, inputs, options)
    except (SchemaError, OSError) as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return 2
    print(summary(stats))
    return 0


def summary(stats: CorpusStats) -> str:
    """What was written, in one line per file."""
    held = (
        f"; {stats.val_tokens:,} tokens of {stats.val_documents:,} held-out documents in {stats.files['val_path']}"
        if "val_path" in stats.files
        else ""
    )
    lines = [
        f"wrote {stats.path} ({stats.tokens:,} tokens from {stats.documents:,} documents, {stats.dtype}, "
        f"vocab {stats.vocab_size:,}, end of text {stats.eot_id}{held}) in {stats.seconds:.1f} s, "
        f"{(stats.tokens + stats.val_tokens) / max(stats.seconds, 1e-9) / 1e6:.2f}M tokens/s"
    ]
    if stats.skipped_line:
        lines.append(stats.skipped_line)
    if "tokenizer" in stats.files:
        lines.append(f"tokenizer: {Path(stats.path).with_name(stats.files['tokenizer'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
