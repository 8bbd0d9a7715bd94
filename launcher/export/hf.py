"""`export --format hf`: a folder transformers' LlamaForCausalLM.from_pretrained loads.

Hugging Face names (launcher/contract/spec/hfnames.py) in `model.safetensors`, or in shards of at most --max-shard-size
with `model.safetensors.index.json`; `config.json`; and, when the run's token file has a tokenizer beside
it (`meshrun data` saved it; its `.json` record names it), `tokenizer.json` and a minimal
`tokenizer_config.json`. Written into a temporary folder beside OUT, then renamed: OUT is whole or untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from meshrun.launcher.contract.spec import hfnames, tokens
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.export import shardwriter as sw
from meshrun.launcher.export.consolidate import OutputError, Source


def hf_entries(source: Source) -> list[sw.Entry]:
    """The checkpoint's tensors under Hugging Face names; a tied head is the embedding's (no lm_head)."""
    entries = [sw.Entry(hfnames.to_hf(e.name), e.shape, e.dtype, e.source) for e in source.entries()]
    if source.model.tie_embeddings:
        entries = [e for e in entries if e.name != hfnames.HF_HEAD]
    return entries


def write_hf(source: Source, out: Path, max_shard_bytes: int) -> tuple[int, list[str]]:
    """The export folder OUT; returns the tensor count and notes (the tokenizer's fate) to print."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(mode=0o700)  # as private as the checkpoint it comes from, whatever the umask
        count = write_weights(source, tmp, max_shard_bytes)
        eot, notes = copy_tokenizer(source, tmp)
        dtype = str(next(iter(source.dtypes.values()))).removeprefix("torch.")
        config = hfnames.hf_config(source.model, dtype, eot)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        replace_folder(tmp, out)
    except OSError as exc:
        raise OutputError(f"{out}: cannot be written ({exc}); check the path and free space") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return count, notes


def write_weights(source: Source, folder: Path, max_shard_bytes: int) -> int:
    """The safetensors files (one, or shards and their index), streamed."""
    entries = hf_entries(source)
    shards = sw.split_shards(entries, max_shard_bytes)
    names = sw.shard_names(len(shards))
    meta = {"format": "pt", "step": str(source.step)}  # "pt": what transformers expects of a torch file
    for shard, name in zip(shards, names):
        sw.write_file(folder / name, shard, source.load, meta)
    if len(shards) > 1:
        (folder / "model.safetensors.index.json").write_text(sw.index_json(shards, names, {}))
    return len(entries)


def copy_tokenizer(source: Source, folder: Path) -> tuple[Optional[int], list[str]]:
    """tokenizer.json and tokenizer_config.json from the run's first token file's record, if it has a
    tokenizer and this machine sees it; returns the end-of-text id and a note saying what happened."""
    data = Path(tokens.training_files(source.job.data)[0]).expanduser()
    try:
        record = tokens.read_record(data)
    except (SchemaError, OSError) as exc:
        return None, [f"no tokenizer copied: {exc}"]
    if record is None or record.tokenizer is None:
        return None, [f"no tokenizer copied: {data} has none (a byte-level token file, or not visible here)"]
    tokenizer = data.parent / record.tokenizer
    try:
        text = tokenizer.read_text()
        shutil.copyfile(tokenizer, folder / "tokenizer.json")
    except OSError as exc:
        return None, [f"no tokenizer copied: {tokenizer}: {exc.strerror or exc}"]
    config = tokenizer_config(text, record.eot_id, source.model.seq_len)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return record.eot_id, [f"tokenizer: {tokenizer}"]


def tokenizer_config(tokenizer_json: str, eot_id: Optional[int], seq_len: int) -> dict[str, Any]:
    """A minimal tokenizer_config.json: a fast tokenizer from tokenizer.json, its end-of-text token as eos."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    try:
        added = json.loads(tokenizer_json).get("added_tokens") or []
    except (ValueError, AttributeError):
        added = []
    eos = next((t.get("content") for t in added if isinstance(t, dict) and t.get("id") == eot_id), None)
    if eos is not None:
        config["eos_token"] = eos
    return config


def replace_folder(new: Path, out: Path) -> None:
    """`new` becomes OUT; an earlier OUT (check_output allowed only an empty folder or an hf export) is
    moved aside first and removed after, so OUT is never half old, half new."""
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    if out.exists():
        os.replace(out, old)
    os.replace(new, out)
    shutil.rmtree(old, ignore_errors=True)
