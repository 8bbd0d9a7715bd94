"""The tokenizers of `meshrun data`: bytes, a byte-level BPE trained on the corpus, or the user's own.

Torch-free; Hugging Face `tokenizers` is imported only when a BPE or a tokenizer.json is asked for (the
bytes path needs nothing beyond the standard library). Every tokenizer encodes a batch of documents at a
time: `tokenizers`' encode_batch spreads it over the cores with its Rust threads.
"""

from __future__ import annotations

import shutil
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, Sequence

from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.contract.spec.tokens import BYTES_VOCAB

EOT = "<|endoftext|>"
"""The end-of-text token a trained BPE gets, and the first name looked for in a user's tokenizer."""
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
"""End-of-text tokens of well-known tokenizers, in the order a user's tokenizer.json is searched."""
BYTES_EOT = 0
"""The bytes tokenizer's end of text: the NUL byte, which text files do not hold, so the vocabulary stays
256 and every byte file built before documents were separated reads as it did."""
KINDS = ("bytes", "bpe")
MIN_BPE_VOCAB = BYTES_VOCAB + 1  # the 256 byte symbols plus the end-of-text token


class Tokenizer(Protocol):
    vocab_size: int
    eot_id: int

    def encode_batch(self, documents: list[bytes]) -> Sequence[Sequence[int]]:
        """Token ids of each document (without the end-of-text token)."""
        ...

    def save(self, path: Path) -> Optional[Path]:
        """Write the tokenizer file to `path`; None when there is none to write (bytes)."""
        ...


@dataclass(frozen=True)
class BytesTokenizer:
    """One token per byte (vocab 256); NUL (0) ends a document."""

    vocab_size: int = BYTES_VOCAB
    eot_id: int = BYTES_EOT

    def encode_batch(self, documents: list[bytes]) -> Sequence[Sequence[int]]:
        return [array("B", doc) for doc in documents]  # array("H", bytes) would read byte pairs: widen per byte

    def save(self, path: Path) -> Optional[Path]:
        return None


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (trained here or the user's tokenizer.json)."""

    def __init__(self, inner: Any, eot_id: int, source: Optional[Path] = None) -> None:
        self.inner, self.eot_id, self.source = inner, eot_id, source
        self.vocab_size = int(inner.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, documents: list[bytes]) -> Sequence[Sequence[int]]:
        texts = [doc.decode("utf-8", "replace") for doc in documents]  # a stray non-UTF-8 byte: U+FFFD
        # No special tokens per document (a Llama tokenizer would add <s>); documents are joined by EOT.
        encodings = self.inner.encode_batch_fast(texts, add_special_tokens=False)
        return [enc.ids for enc in encodings]  # lists: the token writer converts each once, to its dtype

    def save(self, path: Path) -> Optional[Path]:
        if self.source is not None:
            shutil.copyfile(self.source, path)  # the user's file, byte for byte
        else:
            self.inner.save(str(path))
        return path


def check_kind(name: str, vocab: Optional[int]) -> None:
    """Refuse an unknown tokenizer and a vocab that does not fit it, before any text is read."""
    if name in KINDS:
        if name == "bytes" and vocab not in (None, BYTES_VOCAB):
            raise SchemaError(
                "--vocab",
                vocab,
                f"the bytes tokenizer has a vocab of {BYTES_VOCAB}; drop --vocab or use --tokenizer bpe",
            )
        if name == "bpe" and (vocab is None or vocab < MIN_BPE_VOCAB):
            raise SchemaError(
                "--vocab",
                vocab,
                f"a BPE needs a vocab of at least {MIN_BPE_VOCAB} (256 bytes + end of text), e.g. 32000",
            )
        return
    path = Path(name).expanduser()
    if not path.name.endswith(".json"):
        raise SchemaError("--tokenizer", name, f"unknown tokenizer; use {' or '.join(KINDS)}, or a tokenizer.json file")
    if not path.is_file():
        raise SchemaError("--tokenizer", name, "no such tokenizer file; give the path of a Hugging Face tokenizer.json")


def train_bpe(documents: Iterable[bytes], vocab: int) -> HFTokenizer:
    """A byte-level BPE of `vocab` ids (the end-of-text token included) trained on `documents`."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    inner = HF(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, seen in training or not
        show_progress=False,
    )
    inner.train_from_iterator((doc.decode("utf-8", "replace") for doc in documents), trainer=trainer)
    return HFTokenizer(inner, int(inner.token_to_id(EOT)))


def load_tokenizer_file(path: Path, vocab: Optional[int], eot: Optional[str]) -> HFTokenizer:
    """The user's tokenizer.json; its vocab must match --vocab when both are given."""
    from tokenizers import Tokenizer as HF

    try:
        inner = HF.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise SchemaError("--tokenizer", str(path), f"not a Hugging Face tokenizer.json ({exc})") from None
    tokenizer = HFTokenizer(inner, eot_id=_eot_id(inner, path, eot), source=path)
    if vocab is not None and vocab != tokenizer.vocab_size:
        raise SchemaError(
            "--vocab",
            vocab,
            f"{path} has a vocab of {tokenizer.vocab_size}; drop --vocab or give {tokenizer.vocab_size}",
        )
    return tokenizer


def _eot_id(inner: Any, path: Path, eot: Optional[str]) -> int:
    names = (eot,) if eot else EOT_NAMES
    for name in names:
        found = inner.token_to_id(name)
        if found is not None:
            return int(found)
    if eot:
        raise SchemaError("--eot", eot, f"{path} has no such token; name its end-of-text token")
    raise SchemaError(
        "--tokenizer", str(path), f"none of {', '.join(EOT_NAMES)} is in it; name its end-of-text token with --eot"
    )


def dtype_for(vocab: int) -> str:
    """The narrowest token dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    return "uint16" if vocab <= 1 << 16 else "uint32"
