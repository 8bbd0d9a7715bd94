"""Memory-mapped token data, sampled disjointly across data-parallel ranks, resumable.

The token file is split into non-overlapping windows of seq_len+1 tokens (inputs
plus the shifted targets); the tail `val_fraction` is held out for validation.
Every optimizer step draws `global_batch` windows from a per-epoch permutation
seeded by (seed, epoch); dp rank r takes the r-th contiguous slice of them. The
only state is how many windows have been consumed, counted globally, so a resume
continues exactly, even with a different dp degree, as long as the global batch
is unchanged. Ranks of one tp group and of one pipeline (the same dp rank) read the
same windows; `Prefetcher` reads the next steps in a background thread.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import torch

from launcher.corpus import read_sidecar
from launcher.schema import SchemaError
from launcher.spec import Data

Split = Literal["train", "val"]
MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
"""One optimizer step's micro batches on one rank: (inputs, targets), each (micro_batch, seq_len)."""
_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
_SUFFIX_DTYPES = {".u16": "uint16", ".u32": "uint32", ".bin": "uint16"}


def token_dtype(path: Path) -> str:
    """The file's token dtype: from its `.json` sidecar, else from the suffix (.u32), else uint16."""
    meta = read_sidecar(path)
    if meta and "dtype" in meta:
        if meta["dtype"] not in _DTYPES:
            raise SchemaError(f"{path}.json dtype", meta["dtype"], f"expected one of {', '.join(_DTYPES)}")
        return meta["dtype"]
    return _SUFFIX_DTYPES.get(path.suffix, "uint16")


def open_tokens(path: str | Path) -> torch.Tensor:
    """Memory-map a token file as a 1-D integer tensor (private mapping: never written back)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"data.path: {str(path)!r}: no token file there; build it with "
            f"`meshrun data` (or point data.path at a uint16 token file)"
        )
    dtype = token_dtype(path)
    itemsize = 2 if dtype == "uint16" else 4
    size = path.stat().st_size
    if size % itemsize:
        raise SchemaError(
            "data.path",
            str(path),
            f"{size} bytes is not a whole number of {dtype} tokens; is it a token file of that dtype?",
        )
    return torch.from_file(str(path), shared=False, size=size // itemsize, dtype=_DTYPES[dtype])


class TokenDataset:
    """Train/val windows of `seq_len + 1` tokens over one memory-mapped token file."""

    def __init__(self, path: str | Path, seq_len: int, val_fraction: float = 0.05) -> None:
        if not 0.0 <= val_fraction < 1.0:
            raise SchemaError("data.val_fraction", val_fraction, "use a fraction in [0, 1)")
        self.path = Path(path).expanduser()
        self.tokens = open_tokens(self.path)
        self.seq_len = seq_len
        self.window = seq_len + 1  # non-overlapping: the windows of two ranks never share a token
        n_val = int(len(self.tokens) * val_fraction)
        self.val_start = len(self.tokens) - n_val
        self.num_windows = {"train": self.val_start // self.window, "val": n_val // self.window}
        if len(self.tokens) == 0:
            raise SchemaError(
                "data.path",
                str(self.path),
                "the token file is empty; rebuild it (`meshrun data`) or point data.path at another token file",
            )
        if self.num_windows["train"] == 0:
            raise SchemaError(
                "data.path",
                str(self.path),
                f"{self.val_start} training tokens are fewer than one "
                f"window of seq_len+1={self.window}; use a bigger file or a shorter seq_len",
            )

    def sample(self, split: Split, index: int) -> torch.Tensor:
        """Window `index` of `split` as int64 tokens, shape (seq_len + 1,)."""
        if not 0 <= index < self.num_windows[split]:
            raise IndexError(f"{split} window {index} out of range 0..{self.num_windows[split] - 1}")
        start = (0 if split == "train" else self.val_start) + index * self.window
        return self.tokens[start : start + self.window].to(torch.int64)

    def batch(self, split: Split, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(indices), seq_len)."""
        rows = torch.stack([self.sample(split, i) for i in indices])
        return rows[:, :-1], rows[:, 1:]


def open_dataset(data: Data, seq_len: int) -> TokenDataset:
    """The data the spec names, as the trainer reads it."""
    return TokenDataset(data.path, seq_len, data.val_fraction)


def largest_token(tokens: torch.Tensor, chunk: int = 1 << 22) -> tuple[int, int]:
    """The largest id in `tokens` and its first position ((-1, -1) when empty).

    In chunks: a 16 MB file takes a few tens of ms, never a full-size int copy
    (torch has no max over uint16, so each chunk is widened first).
    """
    best, where = -1, -1
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk].to(torch.int32)
        top = int(part.max())
        if top > best:
            best, where = top, start + int(part.argmax())
    return best, where


def check_token_ids(dataset: TokenDataset, vocab_size: int) -> None:
    """Refuse ids the model's embedding cannot look up (they would end in torch's IndexError mid-step)."""
    top, where = largest_token(dataset.tokens)
    if top >= vocab_size:
        raise SchemaError(
            "data.path",
            str(dataset.path),
            f"token id {top} (at token {where}) is not below train.model.vocab_size={vocab_size}; "
            f"raise train.model.vocab_size to at least {top + 1}, or rebuild the data with ids "
            f"below {vocab_size}",
        )


def check_train_data(dataset: TokenDataset, global_batch: int) -> None:
    """Refuse a training split smaller than one global batch: every step would repeat the same sequences."""
    have = dataset.num_windows["train"]
    if have < global_batch:
        raise SchemaError(
            "data.path",
            str(dataset.path),
            f"{len(dataset.tokens)} tokens give {have} training sequences of seq_len+1="
            f"{dataset.window} tokens (after holding out data.val_fraction for validation), "
            f"fewer than one global batch of {global_batch}; use a bigger token file, or a "
            "smaller train.global_batch or train.model.seq_len",
        )


@dataclass(frozen=True)
class Layout:
    """How one optimizer step's windows are split over ranks and micro batches."""

    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int

    def __post_init__(self) -> None:
        per_rank = self.micro_batch * self.dp_size
        if self.global_batch % per_rank:
            raise ValueError(
                f"train.global_batch: {self.global_batch}: must be divisible by "
                f"micro_batch({self.micro_batch})*dp({self.dp_size})={per_rank}"
            )

    @property
    def accumulation(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp_size


class TrainStream:
    """This rank's micro batches, step by step, deterministic from (seed, consumed windows)."""

    def __init__(self, dataset: TokenDataset, layout: Layout, seed: int) -> None:
        self.dataset, self.layout, self.seed = dataset, layout, seed
        self.consumed = 0  # windows drawn by all ranks together: the whole resumable position
        self._perm: tuple[int, Optional[torch.Tensor]] = (-1, None)

    def _permutation(self, epoch: int) -> torch.Tensor:
        # One cached permutation: steps walk epochs forward, so at most one is live.
        if self._perm[0] != epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
            self._perm = (epoch, torch.randperm(self.dataset.num_windows["train"], generator=gen))
        return self._perm[1]

    def window_index(self, k: int) -> int:
        """Train window of global sample k (epochs reshuffle with a new permutation)."""
        n = self.dataset.num_windows["train"]
        return int(self._permutation(k // n)[k % n])

    def step_indices(self, consumed: Optional[int] = None) -> list[int]:
        """Windows this rank reads in the step that starts at position `consumed` (default: the next)."""
        consumed = self.consumed if consumed is None else consumed
        first = consumed + self.layout.dp_rank * self.layout.per_rank
        return [self.window_index(k) for k in range(first, first + self.layout.per_rank)]

    def batches_at(self, consumed: int) -> MicroBatches:
        """This rank's micro batches for the step starting at `consumed`; changes no position."""
        indices = self.step_indices(consumed)
        m = self.layout.micro_batch
        return [self.dataset.batch("train", indices[i : i + m]) for i in range(0, len(indices), m)]

    def next_step(self) -> MicroBatches:
        """This rank's micro batches (inputs, targets) for one optimizer step; advances the position."""
        batches = self.batches_at(self.consumed)
        self.consumed += self.layout.global_batch
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "window": self.dataset.window,
            "train_windows": self.dataset.num_windows["train"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses one taken over different data or windows."""
        mine = self.state_dict()
        for key in ("seed", "window", "train_windows"):
            if state[key] != mine[key]:
                # Bad input (exit 2, never requeued): a retry would refuse it again.
                raise SchemaError(
                    "data.path",
                    str(self.dataset.path),
                    f"the checkpoint's data state has {key}={state[key]} but this data gives "
                    f"{mine[key]}; resume with the same data file, seq_len and seed",
                )
        self.consumed = int(state["consumed"])


def val_steps(dataset: TokenDataset, layout: Layout, max_windows: int) -> Iterator[MicroBatches]:
    """This rank's share of a fixed validation set, one global batch at a time, in micro batches.

    The set is the first min(val windows, max_windows) windows cut to a multiple of
    global_batch, and each global batch is split over dp ranks and micro batches exactly
    as a training step is: the same set, and equal-sized micro batches, whatever the layout
    (a pipeline needs its micro-batch count and shape fixed).
    """
    count = min(dataset.num_windows["val"], max_windows) // layout.global_batch * layout.global_batch
    m = layout.micro_batch
    for start in range(0, count, layout.global_batch):
        first = start + layout.dp_rank * layout.per_rank
        mine = list(range(first, first + layout.per_rank))
        yield [dataset.batch("val", mine[i : i + m]) for i in range(0, len(mine), m)]


class Prefetcher:
    """Reads the next steps' micro batches in a background thread, so steps rarely wait for data.

    The stream's position advances only when the trainer takes a step's batches, so
    `stream.state_dict()` is always the position of the next step to train: a checkpoint
    never records batches that were read ahead but not trained on.
    """

    def __init__(self, stream: TrainStream, depth: int = 2, pin_memory: bool = False) -> None:
        self.stream, self.pin_memory = stream, pin_memory
        self._queue: queue.Queue[tuple[int, MicroBatches] | BaseException] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(stream.consumed,), name="meshrun-prefetch", daemon=True
        )  # daemon: a crashed trainer must not hang on it
        self._thread.start()

    def _run(self, consumed: int) -> None:
        try:
            while not self._stop.is_set():
                batches = self.stream.batches_at(consumed)
                if self.pin_memory:  # page-locked: the copy to the GPU can overlap compute
                    batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
                if not self._put((consumed, batches)):
                    return
                consumed += self.stream.layout.global_batch
        except BaseException as exc:  # handed to the trainer, which re-raises it in the main thread
            self._put(exc)

    def _put(self, item: tuple[int, MicroBatches] | BaseException) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next_step(self) -> tuple[MicroBatches, float]:
        """The next step's micro batches and the seconds this call waited for them."""
        start = time.perf_counter()
        item = self._queue.get()
        waited = time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        consumed, batches = item
        if consumed != self.stream.consumed:
            raise RuntimeError(
                f"prefetch read position {consumed} but the stream is at {self.stream.consumed}; "
                "load a data state only before starting the Prefetcher"
            )
        self.stream.consumed = consumed + self.stream.layout.global_batch
        return batches, waited

    def close(self) -> None:
        self._stop.set()
        # A full queue holds the producer in put(timeout=0.1): taking an item frees it now, where
        # otherwise every loop's end (each round of a benchmark) would wait out that timeout.
        try:
            self._queue.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=5)
