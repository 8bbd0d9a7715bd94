"""Build a byte-level token file from text already on this machine.

Torch-free and stdlib-only, so `meshrun data` can run it anywhere (a login node,
a laptop) without the ML stack. The default corpus is the Python standard
library's own .py sources: every machine that runs meshrun has them, they are a
few tens of MB of real text, and needing no download keeps tests and examples
hermetic.

Format: one token per byte, uint16 little-endian (vocab 256), so the file is
`launcher.data`'s native format. A JSON sidecar `<out>.json` records what went in.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
"""Default cap on tokens (= bytes of text): plenty for the reference model, builds in seconds."""
SUFFIXES = (".py",)
"""Which files under a root count as text."""
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})
"""Directories never read: installed third-party packages vary between machines and break determinism."""
VOCAB_SIZE = 256
DTYPE = "uint16"


@dataclass(frozen=True)
class CorpusStats:
    path: str
    """The token file written."""
    tokens: int
    """Tokens in the file (one per byte of source text)."""
    sources: int
    """Files read (the last one possibly truncated at max_bytes)."""
    sha256: str
    """SHA-256 of the token file's bytes."""
    dtype: str = DTYPE
    """Token dtype, little-endian."""
    vocab_size: int = VOCAB_SIZE
    """Token ids are bytes: 0..255."""


def default_roots() -> list[Path]:
    """The standard library of the running interpreter."""
    return [Path(sysconfig.get_paths()["stdlib"])]


def iter_sources(roots: Sequence[Path]) -> Iterator[Path]:
    """Text files under `roots`, in a deterministic order (roots as given, then sorted paths)."""
    for root in roots:
        root = Path(root)
        if root.is_file():
            yield root
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"corpus root {str(root)!r} is neither a file nor a directory")
        yield from _walk_sorted(root)


def _walk_sorted(root: Path) -> Iterator[Path]:
    # os.walk's order depends on the filesystem; sorting both lists in place makes it stable.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if name.endswith(SUFFIXES):
                yield Path(dirpath) / name


def _to_tokens(data: bytes) -> bytes:
    """Bytes -> uint16 little-endian tokens (one per byte)."""
    # Little-endian by construction: low byte = the byte, high byte = 0. Slice assignment is fast.
    tokens = bytearray(2 * len(data))
    tokens[0::2] = data
    return bytes(tokens)


def _write_atomic(path: Path, chunks: Iterator[bytes]) -> str:
    """Write chunks to `path` via tmp + fsync + rename; returns the SHA-256 of what was written."""
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as fh:
            for chunk in chunks:
                digest.update(chunk)
                fh.write(chunk)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # readers see the old file or the whole new one, never a partial one
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def _token_chunks(roots: Sequence[Path], max_bytes: int, counts: dict[str, int]) -> Iterator[bytes]:
    """Token bytes of each source, stopping after `max_bytes` tokens; tallies into `counts`."""
    for source in iter_sources(roots):
        left = max_bytes - counts["tokens"]
        if left <= 0:
            return
        data = source.read_bytes()[:left]
        if not data:
            continue
        counts["tokens"] += len(data)
        counts["sources"] += 1
        yield _to_tokens(data)


def build_corpus(out: Path, roots: Optional[Sequence[Path]] = None, max_bytes: int = DEFAULT_MAX_BYTES) -> CorpusStats:
    """Write a byte-level uint16 token file to `out` (and `out.json`) from the text under `roots`.

    Deterministic: the same roots and max_bytes give the same file, byte for byte.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes: {max_bytes}: give a positive number of tokens")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    roots = list(roots) if roots is not None else default_roots()
    counts = {"tokens": 0, "sources": 0}
    sha = _write_atomic(out, _token_chunks(roots, max_bytes, counts))
    if counts["tokens"] == 0:
        out.unlink(missing_ok=True)
        shown = ", ".join(str(r) for r in roots)
        raise ValueError(
            f"corpus roots: {shown}: no {'/'.join(SUFFIXES)} text found; give a directory that holds source files"
        )
    stats = CorpusStats(path=str(out), tokens=counts["tokens"], sources=counts["sources"], sha256=sha)
    _write_sidecar(out, stats, roots)
    return stats


def sidecar_path(out: Path) -> Path:
    return Path(str(out) + ".json")


def _write_sidecar(out: Path, stats: CorpusStats, roots: Sequence[Path]) -> None:
    meta = asdict(stats)
    del meta["path"]  # the sidecar travels with the file; an absolute path would go stale on a copy
    meta["roots"] = [str(r) for r in roots]
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    _write_atomic(sidecar_path(out), iter([text.encode()]))


def read_sidecar(out: Path) -> Optional[dict]:
    """The sidecar of a token file, or None when it has none."""
    path = sidecar_path(out)
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m launcher.corpus OUT MAX_BYTES [SOURCE...]`: what `meshrun data` runs (the caller's
    side imports nothing of launcher beyond its torch-free contract)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or not args[1].isdigit():
        print("usage: python -m launcher.corpus OUT MAX_BYTES [SOURCE...]", file=sys.stderr)
        return 2
    try:
        stats = build_corpus(Path(args[0]), roots=[Path(a) for a in args[2:]] or None, max_bytes=int(args[1]))
    except (ValueError, OSError) as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args[0]} ({stats.tokens:,} tokens from {stats.sources:,} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
