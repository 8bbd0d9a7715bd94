"""Real data end to end on `local`: `meshrun data` trains a BPE on one folder and encodes another with the
saved tokenizer, a job trains on their blend with the vocabulary taken from the tokenizer, and a vocabulary
too small for the ids is refused when the ranks start (the file, the id and the fix), all through the CLI."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

from tests.helpers.cli import TINY, meshrun, metrics, submitted, wait_for_state

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def build_pair(tmp_path: Path) -> tuple[Path, Path]:
    """a.u16: a BPE of 400 ids trained on the stdlib's json package; b.u16: the logging package, same tokenizer."""
    a, b = tmp_path / "a.u16", tmp_path / "b.u16"
    first = meshrun(tmp_path, "data", str(STDLIB / "json"), "--tokenizer", "bpe", "--vocab", "400", "--out", str(a))
    assert first.returncode == 0 and "vocab 400" in first.stdout, first.stderr
    second = meshrun(
        tmp_path, "data", str(STDLIB / "logging"), "--tokenizer", f"{a}.tokenizer.json", "--out", str(b), check=True
    )
    assert "vocab 400" in second.stdout
    return a, b


def blend_args(a: Path, b: Path, *more: str) -> list[str]:
    blend = f"[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]"
    return [*TINY, "--set", f"data.path={a}", "--set", f"data.blend={blend}", "--set", "train.steps=12", *more]


def test_a_blend_of_bpe_files_trains_with_the_tokenizers_vocab(tmp_path: Path) -> None:
    a, b = build_pair(tmp_path)
    out = meshrun(tmp_path, "submit", *blend_args(a, b, "--set", "train.model.vocab_size=0"), check=True)
    job_id, run_dir = submitted(out)
    row = wait_for_state(tmp_path, job_id, {"COMPLETED", "FAILED"}, timeout=180)
    assert row["state"] == "COMPLETED", row
    spec = json.loads((run_dir / "spec.json").read_text())["job"]
    assert spec["train"]["model"]["vocab_size"] == 400 and [s["weight"] for s in spec["data"]["blend"]] == [3.0, 1.0]
    losses = [r["loss"] for r in metrics(run_dir)]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(400)) < 0.5  # an untrained model over 400 ids, not 256


def test_ids_above_the_vocab_and_another_tokenizer_are_refused_at_submit(tmp_path: Path) -> None:
    """Both before anything is queued (the ranks check every id again: tests/unit/test_rank_outputs_and_bad_input)."""
    a, b = build_pair(tmp_path)
    refused = meshrun(tmp_path, "submit", *blend_args(a, b, "--set", "train.model.vocab_size=256"))
    (line,) = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and f"data.blend[0].path: '{a}': token id " in line, refused.stderr
    assert "raise train.model.vocab_size to at least" in line and "meshrun top" not in refused.stdout
    bytes_file = tmp_path / "c.u16"
    meshrun(tmp_path, "data", str(STDLIB / "json"), "--out", str(bytes_file), check=True)
    refused = meshrun(tmp_path, "submit", *blend_args(a, bytes_file))
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "data.blend[1].path" in lines[0] and "another tokenizer than data.blend[0]" in lines[0], lines
