"""Memory-mapped token data, sampled disjointly across data-parallel ranks, resumable.

Each token file is split into non-overlapping windows of seq_len+1 tokens (inputs plus the shifted
targets). Validation comes from `data.val_path`, else from the held-out documents `meshrun data` wrote
beside `data.path` (its record names them), else from the tail `val_fraction` of `data.path`.

Training reads `data.path`, or the files of `data.blend` mixed by weight. Global sample k of the run is
a pure function of (seed, k): a fixed schedule of BLEND_PERIOD slots says which file it comes from and
the how-manyth of that file's samples it is; each file walks its own per-epoch permutation. Every
optimizer step draws `global_batch` samples and dp rank r takes the r-th contiguous slice of them. The
only state is how many samples have been consumed, counted globally, so a resume continues exactly, even
with a different dp degree, as long as the global batch is unchanged. Ranks of one tp group and of one
pipeline (the same dp rank) read the same windows; `Prefetcher` reads the next steps in a background thread.
"""

from __future__ import annotations

import bisect
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence

import torch

from meshrun.launcher.contract.spec.job import Data
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.contract.spec.tokens import (
    EMPTY,
    TOKEN_WIDTHS,
    read_record,
    split_counts,
    token_dtype,
    too_few_windows,
    torn,
)

Split = Literal["train", "val"]
MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]
"""One optimizer step's micro batches on one rank: (inputs, targets), each (micro_batch, seq_len)."""
_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}
BLEND_PERIOD = 4096
"""Slots of the blend schedule: each file's share of every 4,096 consecutive samples is its weight's,
rounded to a slot (and at least one)."""


def open_tokens(path: str | Path, key: str = "data.path") -> torch.Tensor:
    """Memory-map a token file as a 1-D integer tensor (private mapping: never written back)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise SchemaError(key, str(path), "no token file there; build it with `meshrun data` or fix the path")
    dtype = token_dtype(path, read_record(path))
    itemsize = TOKEN_WIDTHS[dtype]
    size = path.stat().st_size
    if size % itemsize:
        raise SchemaError(key, str(path), torn(size, dtype))
    if size == 0:
        raise SchemaError(key, str(path), EMPTY)
    return torch.from_file(str(path), shared=False, size=size // itemsize, dtype=_DTYPES[dtype])


@dataclass(frozen=True)
class Span:
    """The windows of one region of a token file."""

    key: str
    """The spec key that names the file (for errors)."""
    path: Path
    tokens: torch.Tensor
    """The whole file, memory-mapped."""
    start: int
    """First token of the region."""
    windows: int
    """Whole windows in the region."""

    def window(self, index: int, length: int) -> torch.Tensor:
        begin = self.start + index * length
        return self.tokens[begin : begin + length].to(torch.int64)


def blend_slots(weights: Sequence[float], period: int = BLEND_PERIOD) -> list[int]:
    """Each source's slots in one period: its weight's share by largest remainder, at least one each."""
    total = sum(weights)
    exact = [w / total * period for w in weights]
    slots = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in by_remainder[: max(0, period - sum(slots))]:
        slots[i] += 1
    return slots


def blend_order(slots: Sequence[int]) -> list[int]:
    """The period's slots in order, interleaved evenly (smooth weighted round robin): a short run of steps
    already holds every source near its share."""
    period, current, order = sum(slots), [0] * len(slots), []
    for _ in range(period):
        for i, n in enumerate(slots):
            current[i] += n
        pick = max(range(len(slots)), key=lambda i: (current[i], -i))
        current[pick] -= period
        order.append(pick)
    return order


def nth_of_source(order: Sequence[int], sources: int) -> list[int]:
    """For each slot of the period, how many earlier slots went to the same source."""
    seen, nth = [0] * sources, []
    for source in order:
        nth.append(seen[source])
        seen[source] += 1
    return nth


class TokenDataset:
    """Train windows of one or several token files (a blend) and the validation windows, seq_len + 1 tokens each."""

    def __init__(self, path: str | Path, seq_len: int, val_fraction: float = 0.05) -> None:
        """One token file (`open_dataset` reads a spec's data section, blends included)."""
        self._build(*dataset_spans(Data(path=str(path), val_fraction=val_fraction), seq_len), seq_len)

    @classmethod
    def from_spans(
        cls, train: Sequence[Span], weights: Sequence[float], val: Optional[Span], seq_len: int
    ) -> TokenDataset:
        dataset = cls.__new__(cls)
        dataset._build(train, weights, val, seq_len)
        return dataset

    def _build(self, train: Sequence[Span], weights: Sequence[float], val: Optional[Span], seq_len: int) -> None:
        self.sources, self.val, self.seq_len = list(train), val, seq_len
        self.window = seq_len + 1  # non-overlapping: the windows of two ranks never share a token
        self.path = self.sources[0].path
        self.slots = blend_slots(weights) if len(self.sources) > 1 else [1]
        self.order = blend_order(self.slots)
        self.rank_in_period = nth_of_source(self.order, len(self.slots))
        self.offsets = [sum(s.windows for s in self.sources[:i]) for i in range(len(self.sources))]
        self.num_windows = {"train": sum(s.windows for s in self.sources), "val": val.windows if val else 0}
        self._perms: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}

    @property
    def tokens(self) -> torch.Tensor:
        """The first training file's tokens."""
        return self.sources[0].tokens

    def spans(self) -> list[Span]:
        """Every region read, validation last."""
        return self.sources + ([self.val] if self.val is not None else [])

    def _permutation(self, source: int, epoch: int, seed: int) -> torch.Tensor:
        # One cached permutation per file and seed: its samples walk its epochs forward, so at most one is
        # live (streams of other seeds may share this dataset).
        cached = self._perms.get((source, seed))
        if cached is None or cached[0] != epoch:
            mixed = (seed * 1_000_003 + epoch + (source << 40)) & 0x7FFF_FFFF_FFFF_FFFF
            perm = torch.randperm(self.sources[source].windows, generator=torch.Generator().manual_seed(mixed))
            self._perms[(source, seed)] = cached = (epoch, perm)
        return cached[1]

    def train_index(self, k: int, seed: int) -> int:
        """Train window of global sample k (in the files' concatenated window numbering)."""
        period, slot = divmod(k, len(self.order))
        source = self.order[slot]
        nth = period * self.slots[source] + self.rank_in_period[slot]  # the source's own sample count
        epoch, at = divmod(nth, self.sources[source].windows)
        return self.offsets[source] + int(self._permutation(source, epoch, seed)[at])

    def sample(self, split: Split, index: int) -> torch.Tensor:
        """Window `index` of `split` as int64 tokens, shape (seq_len + 1,)."""
        if not 0 <= index < self.num_windows[split]:
            raise IndexError(f"{split} window {index} out of range 0..{self.num_windows[split] - 1}")
        if split == "val":
            assert self.val is not None
            return self.val.window(index, self.window)
        source = bisect.bisect_right(self.offsets, index) - 1  # every sample of every step comes here
        return self.sources[source].window(index - self.offsets[source], self.window)

    def batch(self, split: Split, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (len(indices), seq_len)."""
        rows = torch.stack([self.sample(split, i) for i in indices])
        return rows[:, :-1], rows[:, 1:]

    def signature(self) -> list[list[int]]:
        """What a saved data position is valid for: each training file's windows and slots."""
        return [[s.windows, n] for s, n in zip(self.sources, self.slots)]


def whole(key: str, path: str | Path, window: int) -> Span:
    tokens = open_tokens(path, key)
    return Span(key, Path(path).expanduser(), tokens, 0, len(tokens) // window)


def held_out_file(path: Path) -> Optional[Path]:
    """The held-out documents `meshrun data` wrote beside token file `path`, if its record names them."""
    record = read_record(path) if path.is_file() else None
    return path.parent / record.val_path if record is not None and record.val_path else None


def open_dataset(data: Data, seq_len: int) -> TokenDataset:
    """The data the spec names, as the trainer reads it."""
    return TokenDataset.from_spans(*dataset_spans(data, seq_len), seq_len)


def split_tail(span: Span, fraction: float, window: int) -> tuple[Span, Span]:
    """A whole file's head for training and its tail `fraction` for validation (data.path's)."""
    head, n_val = split_counts(len(span.tokens), fraction)
    return Span(span.key, span.path, span.tokens, 0, head // window), Span(
        "data.path", span.path, span.tokens, head, n_val // window
    )


def dataset_spans(data: Data, seq_len: int) -> tuple[list[Span], list[float], Optional[Span]]:
    """The training regions with their weights, and the validation region, that `data` names."""
    if not 0.0 <= data.val_fraction < 1.0:
        raise SchemaError("data.val_fraction", data.val_fraction, "use a fraction in [0, 1)")
    window = seq_len + 1
    main = Path(data.path).expanduser()
    separate = Path(data.val_path).expanduser() if data.val_path else held_out_file(main)
    sources = [(f"data.blend[{i}].path", b.path, b.weight) for i, b in enumerate(data.blend)] or [
        ("data.path", data.path, 1.0)
    ]
    val: Optional[Span] = None
    if separate is not None:
        val = whole("data.val_path" if data.val_path else "data.path", separate, window)
    spans = []
    for key, path, _ in sources:
        span = whole(key, path, window)
        if separate is None and span.path == main:  # validation is this file's tail: train on the rest only
            span, val = split_tail(span, data.val_fraction, window)
        spans.append(span)
    if val is None and data.val_fraction > 0:  # a blend without data.path among its files: the tail of data.path
        _, val = split_tail(whole("data.path", main, window), data.val_fraction, window)
    for span in spans:
        if span.windows == 0:
            raise SchemaError(
                span.key,
                str(span.path),
                f"{len(span.tokens)} tokens (before any held-out tail) give no training window of "
                f"seq_len+1={window} tokens; use a bigger file or a shorter seq_len",
            )
    return spans, [w for _, _, w in sources], val


def largest_token(tokens: torch.Tensor, chunk: int = 1 << 22) -> tuple[int, int]:
    """The largest id in `tokens` and its first position ((-1, -1) when empty).

    In chunks: a 16 MB file takes a few tens of ms, never a full-size int copy
    (torch has no max over uint16, so each chunk is widened first).
    """
    best, where = -1, -1
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk].to(torch.int64)
        top = int(part.max())
        if top > best:
            best, where = top, start + int(part.argmax())
    return best, where


def check_token_ids(dataset: TokenDataset, vocab_size: int) -> None:
    """Refuse ids the model's embedding cannot look up (they would end in torch's IndexError mid-step)."""
    seen: set[Path] = set()
    for span in dataset.spans():
        if span.path in seen:
            continue
        seen.add(span.path)
        top, where = largest_token(span.tokens)
        if top >= vocab_size:
            raise SchemaError(
                span.key,
                str(span.path),
                f"token id {top} (at token {where}) is not below train.model.vocab_size={vocab_size}; "
                f"raise train.model.vocab_size to at least {top + 1} (0 takes the tokenizer's), or rebuild "
                f"the data with a tokenizer of at most {vocab_size} ids",
            )


def check_train_data(dataset: TokenDataset, global_batch: int) -> None:
    """Refuse a training split smaller than one global batch: every step would repeat the same sequences."""
    have = dataset.num_windows["train"]
    if have < global_batch:
        first = dataset.sources[0]
        tokens = sum(len(s.tokens) for s in dataset.sources)
        raise too_few_windows(first.key, str(first.path), tokens, have, dataset.window, global_batch)


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

    def window_index(self, k: int) -> int:
        """Train window of global sample k (files and epochs as the dataset's schedule says)."""
        return self.dataset.train_index(k, self.seed)

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
            "blend": self.dataset.signature(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses one taken over different data or windows."""
        mine = self.state_dict()
        for key in ("seed", "window", "train_windows", "blend"):
            if key in state and state[key] != mine[key]:  # "blend": not in checkpoints older than blends
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


PUT_WAIT_S = 0.1
"""How long the producer waits in each put on a full queue before it looks at the stop flag again."""


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
                self._queue.put(item, timeout=PUT_WAIT_S)
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
