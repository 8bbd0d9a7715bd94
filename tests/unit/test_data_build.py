"""`meshrun data` on real text (formats, tokenizers, documents, the held-out split) and the ranks' reading
of what it wrote (the held-out file, blends, ids above the vocab), through the real modules and CLI."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from meshrun.launcher.contract.spec import tokens
from meshrun.launcher.contract.spec.job import BlendSource, Data, JobSpec, Model, Train
from meshrun.launcher.contract.spec.schema import SchemaError
from meshrun.launcher.data import corpus
from meshrun.launcher.data.dataset import (
    BLEND_PERIOD,
    Layout,
    TrainStream,
    blend_order,
    blend_slots,
    check_token_ids,
    open_dataset,
)
from meshrun.launcher.data.textsources import Inputs, iter_files
from meshrun.launcher.data.tokenizer import EOT

REPO = Path(__file__).resolve().parents[2]


def ids_of(path: Path, dtype: torch.dtype = torch.uint16) -> list[int]:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=dtype).to(torch.int64).tolist()


def documents_of(ids: list[int], eot: int) -> list[list[int]]:
    """The documents of a token stream: every one ends with the end-of-text id."""
    assert ids and ids[-1] == eot
    docs, current = [], []
    for i in ids:
        if i == eot:
            docs.append(current)
            current = []
        else:
            current.append(i)
    return docs


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    """A folder of the formats users have: prose, markdown, a .jsonl with a text field, code, and a PNG."""
    root = tmp_path / "texts"
    (root / "notes").mkdir(parents=True)
    for i in range(30):
        (root / "notes" / f"n{i:02d}.txt").write_text(f"Note {i}: the quick brown fox jumps over the lazy dog.\n")
    (root / "README.md").write_text("# Title\n\nSome *markdown* text.\n")
    rows = [{"text": "first json document", "id": 1}, {"text": "second json document", "id": 2}]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    (root / "code.py").write_text("def f(x):\n    return x + 1\n")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n")  # not text: a folder's other files are skipped
    return root


def build(out: Path, inputs: list[Path], **options: object) -> corpus.CorpusStats:
    return corpus.build(out, Inputs(tuple(str(p) for p in inputs)), corpus.BuildOptions(**options))  # type: ignore[arg-type]


def test_formats_are_read_as_documents_each_ended_by_end_of_text(texts: Path, tmp_path: Path) -> None:
    stats = build(tmp_path / "t.u16", [texts])
    docs = documents_of(ids_of(tmp_path / "t.u16"), eot=0)
    as_text = [bytes(d).decode() for d in docs]
    # a folder's files in sorted order, then its folders': README.md, code.py, rows.jsonl (one document per
    # line, its "text" field), notes/...
    assert as_text[0].startswith("# Title") and as_text[1].startswith("def f(x)")
    assert as_text[2:4] == ["first json document", "second json document"] and as_text[4].startswith("Note 0:")
    assert stats.documents == len(docs) == 1 + 1 + 30 + 2 and stats.dtype == "uint16" and stats.vocab_size == 256
    again = build(tmp_path / "u.u16", [texts])
    assert again.sha256 == stats.sha256  # deterministic, byte for byte


def test_a_glob_and_a_named_file_are_read_and_an_unknown_format_is_one_line(texts: Path, tmp_path: Path) -> None:
    stats = build(tmp_path / "g.u16", [texts / "notes" / "n0*.txt", texts / "code.py"])
    assert stats.documents == 11
    with pytest.raises(SchemaError, match=r"unknown format '\.png'; accepted: \.txt"):
        build(tmp_path / "x.u16", [texts / "logo.png"])
    with pytest.raises(SchemaError, match="matches no file"):
        build(tmp_path / "x.u16", [texts / "*.nothing"])
    assert not (tmp_path / "x.u16").exists()


def test_a_jsonl_line_without_the_field_names_the_file_the_line_and_its_keys(texts: Path, tmp_path: Path) -> None:
    inputs = Inputs((str(texts / "rows.jsonl"),), field="body")
    with pytest.raises(SchemaError, match=r"rows\.jsonl:1: .*no such field \(it has: id, text\)"):
        corpus.build(tmp_path / "x.u16", inputs, corpus.BuildOptions())


def test_the_cli_refuses_bad_input_in_one_line_and_exit_2(texts: Path, tmp_path: Path) -> None:
    cases = {
        ("--tokenizer", "sentencepiece"): "unknown tokenizer",
        ("--tokenizer", "bpe"): "a BPE needs a vocab",
        ("--vocab", "1000"): "the bytes tokenizer has a vocab of 256",
        ("--val-fraction", "1.5"): "give a fraction in [0, 1)",
        ("--tokenizer", str(tmp_path / "none.json")): "no such tokenizer file",
    }
    for flags, message in {**cases, (str(texts / "logo.png"),): "unknown format"}.items():
        done = subprocess.run(
            [
                str(Path(sys.executable).with_name("meshrun")),
                "data",
                str(texts),
                *flags,
                "--out",
                str(tmp_path / "x.u16"),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], (flags, done.stderr)
        assert "Traceback" not in done.stderr and not (tmp_path / "x.u16").exists()
        if "unknown format" in message:  # the positional argument by its usage name: there is no --input flag
            assert lines[0].startswith("meshrun: error: INPUT: ") and "--input" not in lines[0], lines[0]


def test_a_bpe_is_trained_saved_beside_and_decodes_back_to_the_documents(texts: Path, tmp_path: Path) -> None:
    out = tmp_path / "bpe.u16"
    stats = build(out, [texts], tokenizer="bpe", vocab=300)
    record = tokens.read_record(out)
    assert record is not None and record.vocab_size == stats.vocab_size == 300 and record.dtype == "uint16"
    saved = Tokenizer.from_file(str(out.with_name(record.tokenizer or "")))
    assert stats.eot_id == saved.token_to_id(EOT) and record.eot_id == stats.eot_id
    docs = documents_of(ids_of(out), stats.eot_id)
    build(tmp_path / "b.u16", [texts])
    plain = documents_of(ids_of(tmp_path / "b.u16"), 0)
    assert [saved.decode(d) for d in docs] == [bytes(d).decode() for d in plain]
    assert stats.tokens < sum(len(d) + 1 for d in plain)  # merges: fewer tokens than bytes


def test_a_users_tokenizer_json_is_copied_byte_for_byte_and_gives_the_same_ids(texts: Path, tmp_path: Path) -> None:
    first = build(tmp_path / "a.u16", [texts], tokenizer="bpe", vocab=300)
    mine = tmp_path / "a.u16.tokenizer.json"
    second = build(tmp_path / "b.u16", [texts], tokenizer=str(mine))
    assert second.sha256 == first.sha256 and second.eot_id == first.eot_id
    assert (tmp_path / "b.u16.tokenizer.json").read_bytes() == mine.read_bytes()
    with pytest.raises(SchemaError, match="has a vocab of 300; drop --vocab or give 300"):
        build(tmp_path / "c.u16", [texts], tokenizer=str(mine), vocab=512)


def test_a_vocab_above_65536_writes_uint32_ids(tmp_path: Path) -> None:
    vocab = {f"w{i}": i for i in range(70_000)} | {EOT: 70_000, "[UNK]": 70_001}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    from tokenizers import pre_tokenizers

    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536")
    stats = build(tmp_path / "big.u32", [tmp_path / "doc.txt"], tokenizer=str(tmp_path / "big.json"))
    assert stats.dtype == "uint32" and stats.vocab_size == 70_002 and stats.eot_id == 70_000
    assert ids_of(tmp_path / "big.u32", torch.uint32) == [1, 69_999, 65_536, 70_000]


def test_validation_is_held_out_by_whole_document_and_stays_put_when_documents_are_added(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(60):
        (folder / f"d{i:02d}.txt").write_text(f"document number {i} " * (i % 5 + 1))
    stats = build(tmp_path / "t.u16", [folder], val_fraction=0.3, seed=7)
    val_docs = {bytes(d).decode() for d in documents_of(ids_of(tmp_path / "t.val.u16"), 0)}
    train_docs = {bytes(d).decode() for d in documents_of(ids_of(tmp_path / "t.u16"), 0)}
    every = {(folder / f"d{i:02d}.txt").read_text() for i in range(60)}
    assert val_docs | train_docs == every and not val_docs & train_docs  # whole documents, each in one split
    assert 5 <= stats.val_documents <= 35 and stats.val_documents == len(val_docs)
    for i in range(60, 90):  # a bigger corpus: no document moves between the splits
        (folder / f"d{i:02d}.txt").write_text(f"another document {i}")
    build(tmp_path / "more.u16", [folder], val_fraction=0.3, seed=7)
    more_val = {bytes(d).decode() for d in documents_of(ids_of(tmp_path / "more.val.u16"), 0)}
    assert more_val & every == val_docs
    record = tokens.read_record(tmp_path / "t.u16")
    assert record is not None and record.val_path == "t.val.u16"


def test_the_progress_line_shows_tokens_per_second(texts: Path, tmp_path: Path) -> None:
    shown = io.StringIO()
    build(tmp_path / "t.u16", [texts], progress=shown)
    assert shown.getvalue().startswith("\rmeshrun data: ") and "tokens/s" in shown.getvalue()
    assert shown.getvalue().endswith("\n")


# ------------------------------------------------------------------ what the ranks read


def token_file(path: Path, ids: list[int], vocab: int = 256) -> Path:
    path.write_bytes(torch.tensor(ids, dtype=torch.int64).to(torch.uint16).numpy().tobytes())
    if vocab != 256:
        path.with_name(path.name + ".json").write_text(json.dumps({"vocab_size": vocab, "dtype": "uint16"}))
    return path


def test_the_ranks_validate_on_the_held_out_file_and_train_on_the_whole_token_file(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"d{i:02d}.txt").write_text(f"document {i} " * 20)
    stats = build(tmp_path / "t.u16", [folder], val_fraction=0.25)
    ds = open_dataset(Data(path=str(tmp_path / "t.u16"), val_fraction=0.05), seq_len=15)
    assert ds.val is not None and ds.val.path == tmp_path / "t.val.u16" and ds.val.start == 0
    assert ds.num_windows == {"train": stats.tokens // 16, "val": stats.val_tokens // 16}  # no tail cut
    explicit = open_dataset(Data(path=str(tmp_path / "t.u16"), val_path=str(tmp_path / "t.u16")), seq_len=15)
    assert explicit.val is not None and explicit.val.path == tmp_path / "t.u16"


def blend_of(tmp_path: Path, weights: tuple[float, float], sizes: tuple[int, int] = (4000, 2000)) -> Data:
    a = token_file(tmp_path / "a.u16", [1] * sizes[0])  # every window of a is all ones, of b all twos
    b = token_file(tmp_path / "b.u16", [2] * sizes[1])
    return Data(path=str(a), val_fraction=0.0, blend=(BlendSource(str(a), weights[0]), BlendSource(str(b), weights[1])))


def test_blend_slots_and_order_follow_the_weights() -> None:
    assert blend_slots([3, 1]) == [3072, 1024] and sum(blend_slots([1, 1, 1])) == BLEND_PERIOD
    assert blend_slots([1e-9, 1]) == [1, BLEND_PERIOD - 1]  # a tiny weight still gets read
    order = blend_order([3, 1])
    assert order == [0, 0, 1, 0]  # interleaved: every window of 4 holds the shares


def test_a_blend_mixes_by_weight_the_same_for_any_layout_and_resumes_exactly(tmp_path: Path) -> None:
    ds = open_dataset(blend_of(tmp_path, (3.0, 1.0)), seq_len=15)
    one = TrainStream(ds, Layout(16, 4, 0, 1), seed=5)
    first_tokens = [int(ds.sample("train", one.window_index(k))[0]) for k in range(BLEND_PERIOD)]
    assert first_tokens.count(1) == 3072 and first_tokens.count(2) == 1024
    two = [TrainStream(ds, Layout(16, 2, r, 2), seed=5) for r in range(2)]
    for _ in range(30):  # more than an epoch of b (125 windows): its permutation walks on
        assert two[0].step_indices() + two[1].step_indices() == one.step_indices()
        one.next_step()
        for s in two:
            s.next_step()
    saved = one.state_dict()
    again = TrainStream(open_dataset(blend_of(tmp_path, (3.0, 1.0)), seq_len=15), Layout(16, 4, 0, 1), seed=5)
    again.load_state_dict(saved)
    assert again.step_indices() == one.step_indices()
    other = TrainStream(open_dataset(blend_of(tmp_path, (1.0, 1.0)), seq_len=15), Layout(16, 4, 0, 1), seed=5)
    with pytest.raises(SchemaError, match="the checkpoint's data state has blend="):
        other.load_state_dict(saved)


def test_each_blend_file_walks_all_its_windows_once_per_epoch(tmp_path: Path) -> None:
    ds = open_dataset(blend_of(tmp_path, (1.0, 1.0)), seq_len=15)
    stream = TrainStream(ds, Layout(8, 8, 0, 1), seed=0)
    b_windows = ds.sources[1].windows
    seen = [i - ds.offsets[1] for i in (stream.window_index(k) for k in range(2 * b_windows)) if i >= ds.offsets[1]]
    assert sorted(seen) == list(range(b_windows))


def test_an_id_above_the_vocab_in_a_blend_file_names_that_file_and_the_id(tmp_path: Path) -> None:
    data = blend_of(tmp_path, (1.0, 1.0))
    token_file(tmp_path / "b.u16", [2] * 1000 + [900] + [2] * 999)
    with pytest.raises(SchemaError, match=r"data\.blend\[1\]\.path: .*b\.u16.*token id 900 \(at token 1000\)"):
        check_token_ids(open_dataset(data, seq_len=15), vocab_size=256)


def test_blend_weights_and_tokenizers_are_checked_before_submission(tmp_path: Path) -> None:
    data = blend_of(tmp_path, (1.0, -2.0))
    with pytest.raises(SchemaError, match=r"data\.blend\[1\]\.weight: -2\.0: give a positive weight"):
        tokens.check_data_files(JobSpec(name="x", data=data))
    mixed = blend_of(tmp_path, (1.0, 1.0))
    token_file(tmp_path / "b.u16", [2] * 2000, vocab=512)
    with pytest.raises(SchemaError, match=r"data\.blend\[1\]\.path: .*another tokenizer than data\.blend\[0\]"):
        tokens.check_data_files(JobSpec(name="x", data=mixed))


def _job(path: Path, vocab: int) -> JobSpec:
    return JobSpec(name="x", data=Data(path=str(path), val_fraction=0.0), train=Train(model=Model(vocab_size=vocab)))


@pytest.mark.parametrize(
    ("content", "vocab", "message"),
    [
        (
            '{"text": "a document"}\n' * 300,
            256,
            r"data\.path: .*corpus\.u16'?: is text, not token ids; name it \.txt, \.md or \.jsonl and make token ids",
        ),
        (
            b"PAR1" + bytes(range(1, 200)),
            256,
            r"is a Parquet file, not token ids: unpack it, then build a token file .*meshrun data TEXTS --out OUT\.u16",
        ),
        (
            bytes([0, 1, 0]),
            256,
            r"3 bytes is not a whole number of uint16 tokens \(cut short, or not a token file\)",
        ),
        ('{"text": "short"}\n' * 4, 0, r"is text, not token ids"),  # 72 bytes of ASCII: text however short
        ([5, 1000, 7], 0, r"holds token id 1000, but a file without a record is read as bytes .*give train\.model"),
        ([5, 300, 7], 256, r"token id 300 \(in its first MiB\) is not below train\.model\.vocab_size=256; raise"),
    ],
)
def test_a_file_that_is_not_token_ids_is_refused_at_submit(
    tmp_path: Path, content: object, vocab: int, message: str
) -> None:
    """Preflight on the machine that sees the data (the local cluster, a login node; the ranks check again):
    text, a container, a torn file or ids beyond the vocabulary, each one line naming the key, the path and the fix."""
    path = tmp_path / "corpus.u16"
    if isinstance(content, list):
        token_file(path, content)
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)  # type: ignore[attr-defined]
    with pytest.raises(SchemaError, match=message):
        tokens.check_data_files(_job(path, vocab))


def test_a_token_file_too_small_for_one_global_batch_is_refused_at_submit(tmp_path: Path) -> None:
    """Counted from the file's size as the ranks count it: 400 tokens, 5% held out, windows of 33 (seq 32)."""
    path = token_file(tmp_path / "small.u16", [1] * 400)
    job = JobSpec(
        name="x", data=Data(path=str(path)), train=Train(model=Model(seq_len=32), global_batch=16, micro_batch=4)
    )
    with pytest.raises(
        SchemaError,
        match=r"400 tokens give 11 training sequences of seq_len\+1=33 tokens .*fewer than one global batch of 16",
    ):
        tokens.check_data_files(job)
    enough = dataclasses.replace(job, train=dataclasses.replace(job.train, global_batch=8, micro_batch=4))
    tokens.check_data_files(enough)
    dataset = open_dataset(job.data, seq_len=32)
    assert dataset.num_windows["train"] == 11  # the ranks' own count agrees


def test_token_files_of_a_users_own_or_a_recorded_vocabulary_pass(tmp_path: Path) -> None:
    own = token_file(tmp_path / "own.u16", [5, 1000, 7] * 3000)  # no record: ids up to the model's vocab_size
    tokens.check_data_files(_job(own, 2000))
    recorded = token_file(tmp_path / "bpe.u16", [5, 500, 7] * 3000, vocab=512)
    tokens.check_data_files(_job(recorded, 0))
    token_file(tmp_path / "torn.u16", [5, 600, 7] * 3000, vocab=512)
    with pytest.raises(SchemaError, match=r"holds token id 600, beyond the 512 ids its record says"):
        tokens.check_data_files(_job(tmp_path / "torn.u16", 0))


# ------------------------------------------------------------------ nothing cut, nothing dropped silently


def run_data(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("meshrun")), "data", *args], capture_output=True, text=True, cwd=REPO
    )


def test_a_users_corpus_past_the_default_corpus_cap_is_read_whole(tmp_path: Path) -> None:
    """27 MB of a user's text became its first 16 MB, the last document cut, exit 0 and not a
    word. A user's inputs are read whole; the 16 MiB cap is the default corpus's."""
    folder = tmp_path / "big"
    folder.mkdir()
    sizes = [7_000_000, 7_000_000, 4_000_000]  # 18 MB: past the default corpus's 16 MiB
    for i, size in enumerate(sizes):
        (folder / f"part{i}.txt").write_bytes(bytes([65 + i]) * size)
    out = tmp_path / "big.u16"
    done = run_data(str(folder), "--out", str(out), "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    docs = documents_of(ids_of(out), eot=0)
    assert [len(d) for d in docs] == sizes and [d[0] for d in docs] == [65, 66, 67]  # every one whole
    record = json.loads(out.with_name("big.u16.json").read_text())
    assert record["sources"] == record["documents"] == 3 and record["text_bytes"] == sum(sizes)
    assert record["max_bytes"] is None and "skipped" not in done.stdout


def test_a_cap_reads_whole_documents_and_the_summary_says_what_was_skipped(texts: Path, tmp_path: Path) -> None:
    (texts / "notes" / "empty.txt").write_text("")  # no document: said
    (texts / ".git").mkdir()  # never read: said
    (texts / ".git" / "HEAD.txt").write_text("ref: refs/heads/main\n")
    whole = build(tmp_path / "all.u16", [texts])
    assert whole.skipped == {
        "other_format_files": 1,
        "folders": 1,
        "empty_documents": 1,
        "unread_files": 0,
        "unread_bytes": 0,
    }
    assert whole.skipped_line == (
        "skipped: 1 file(s) of other formats in folders (.png); 1 folder(s) never read (.git); 1 empty document(s)"
    )
    # A cap of 200 bytes: README.md, code.py, the two .jsonl rows, then the notes stop before the one that
    # would cross it; nothing is cut.
    out = tmp_path / "capped.u16"
    done = run_data(str(texts), "--out", str(out), "--val-fraction", "0", "--max-mb", "0.0002")
    assert done.returncode == 0, done.stderr
    docs = [bytes(d).decode() for d in documents_of(ids_of(out), eot=0)]
    originals = {p.read_text() for p in texts.rglob("*.txt")} | {(texts / "README.md").read_text()}
    assert all(d in originals or d.endswith("json document") or d.startswith("def f") for d in docs), docs
    read = sum(len(d.encode()) for d in docs)
    assert read <= 200 < read + len((texts / "notes" / "n00.txt").read_bytes())
    unread = 30 - (len(docs) - 4)  # the notes not read (empty.txt sorts first: read, and counted as empty)
    lines = done.stdout.splitlines()
    assert lines[1].startswith(f"skipped: not read past the 0.0002 MB cap (--max-mb): {unread} file(s)"), lines
    record = json.loads(out.with_name("capped.u16.json").read_text())
    assert record["skipped"]["unread_files"] == unread and record["max_bytes"] == 200


def test_a_cap_inside_a_jsonl_names_the_file_whose_rest_was_not_read(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i:03d}"}) + "\n" for i in range(100)))
    stats = build(tmp_path / "r.u16", [rows], max_bytes=70)
    assert stats.documents == 10 and stats.text_bytes == 70  # "row 000" is 7 bytes: ten rows, whole
    assert stats.skipped_line == f"skipped: not read past the 7e-05 MB cap (--max-mb): the rest of {rows}"


def test_the_default_corpus_keeps_its_cap_in_whole_documents(tmp_path: Path) -> None:
    stats = corpus.build_corpus(tmp_path / "std.u16", max_bytes=50_000, val_fraction=0.0)
    assert stats.max_bytes == 50_000 and stats.text_bytes <= 50_000 and stats.tokens == stats.text_bytes + stats.sources
    docs = [bytes(d) for d in documents_of(ids_of(tmp_path / "std.u16"), eot=0)]
    files = [data for data in (p.read_bytes() for p in iter_files(corpus.default_inputs())) if data]
    assert docs == files[: len(docs)] and len(files[len(docs)]) + stats.text_bytes > 50_000  # whole files
    assert "not read past the 0.05 MB cap" in stats.skipped_line


def test_data_help_names_the_path_a_spec_reads_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """`--out`'s help states its default; the one definition is the spec's (checked here, not copied)."""
    from meshrun.launcher.contract.spec.job import DEFAULT_DATA_PATH
    from meshrun.submit.cli import main as cli

    with pytest.raises(SystemExit):
        cli.main(["data", "--help"])
    assert DEFAULT_DATA_PATH in " ".join(capsys.readouterr().out.split())
