"""`meshrun plan`, the fit check of `meshrun submit` and model presets, through the real CLI (no cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshrun.launcher.contract.spec.job import Model
from meshrun.launcher.contract.spec.modelshape import param_count
from meshrun.launcher.contract.spec.presets import PRESETS
from meshrun.submit.cli import main as cli
from meshrun.submit.planning.plan import load_job

REPO = Path(__file__).resolve().parents[2]
LLAMA70B = {"n_layers": 80, "d_model": 8192, "n_heads": 64, "vocab_size": 32000, "seq_len": 4096, "ffn_mult": 3.5}
LLAMA7B = dict(PRESETS["llama-7b"])


def write_spec(tmp_path: Path, model: dict[str, Any], dp_mode: str = "ddp", **train: Any) -> Path:
    spec = {
        "name": "big",
        "resources": {"nodes": 1, "gpus_per_node": 8},
        "parallel": {"dp": 8, "dp_mode": dp_mode},
        "train": {"model": model, "precision": "bf16", "global_batch": 64, "micro_batch": 1, **train},
        "data": {"path": "/lustre/alice/data/tokens.u16"},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def gpu_profile(tmp_path: Path) -> Path:
    """A Slurm profile reached without SSH (so --dry-run sends nothing anywhere) with 8 x H100 80GB nodes."""
    text = (REPO / "cluster_configs/h100-ndr.yaml").read_text().split("\nssh:")[0]
    rest = (REPO / "cluster_configs/h100-ndr.yaml").read_text().split("\npaths:", 1)[1]
    path = tmp_path / "gpus.yaml"
    path.write_text(text + "\npaths:" + rest.replace("/lustre/alice", str(tmp_path)))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_refuses_70b_in_ddp_on_8_h100_with_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's example. h100-ndr is reached over SSH: exit 2 proves the refusal came before any connection."""
    code, _, err = run(capsys, "submit", str(write_spec(tmp_path, LLAMA70B)), "-c", "h100-ndr")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "parallel: 'dp=8 tp=1 pp=1 ddp': needs" in err and "usable of 80 GiB on partition 'gpu' (h100)" in err
    assert "no layout fits 1 node(s); it fits on 4: set resources.nodes=4" in err and "--force" in err


def test_submit_names_the_nearest_layout_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "submit", str(write_spec(tmp_path, LLAMA7B)), "-c", "h100-ndr")
    assert code == 2
    assert err.rstrip().endswith(
        "set parallel.dp_mode=fsdp (`meshrun plan` shows the estimate; --force submits anyway)"
    )


def test_force_submits_what_does_not_fit_and_a_job_that_fits_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = str(gpu_profile(tmp_path))
    spec = str(write_spec(tmp_path, LLAMA7B))
    assert run(capsys, "submit", spec, "-c", profile, "--dry-run")[0] == 2
    code, out, err = run(capsys, "submit", spec, "-c", profile, "--dry-run", "--force")
    assert code == 0, err
    assert "nothing was sent" in err and "dp_mode=ddp" in out
    fits = str(write_spec(tmp_path, LLAMA7B, dp_mode="fsdp"))
    assert run(capsys, "submit", fits, "-c", profile, "--dry-run")[0] == 0


@pytest.mark.parametrize("example", ["tiny.yaml", "gpt-3d.yaml", "command.yaml", "deepspeed-command.yaml"])
def test_cpu_and_command_jobs_are_never_refused(
    example: str, capsys: pytest.CaptureFixture[str], default_corpus: Path
) -> None:
    code, _, err = run(capsys, "submit", str(REPO / "examples" / example), "-c", "local", "--dry-run")
    assert code == 0, err


def test_plan_json_has_the_documented_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", str(write_spec(tmp_path, LLAMA7B, dp_mode="fsdp")), "-c", "h100-ndr", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["params"] == param_count(Model(**LLAMA7B))
    mem = plan["memory_per_gpu_bytes"]
    parts = mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"] + mem["allowance"]
    assert mem["total"] == parts
    assert plan["fits"] is True and plan["fits_by_partition"] == {"gpu": True}
    assert plan["tokens_per_s"] == pytest.approx(64 * 4096 / plan["step_time_s"])
    assert plan["mfu"] == pytest.approx(plan["flops_per_step"] / (plan["step_time_s"] * 8 * 989e12))
    rec = plan["recommended"]
    for key in ("dp", "tp", "pp", "micro_batch", "accumulation", "activation_checkpointing"):
        assert key in rec
    assert rec["dp"] * rec["tp"] * rec["pp"] == 8 and rec["tp"] <= 8
    assert rec["micro_batch"] * rec["accumulation"] * rec["dp"] == 64
    assert rec["tokens_per_s"] >= plan["tokens_per_s"]  # the search saw the spec's own layout too


def test_plan_text_and_the_gpu_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", str(write_spec(tmp_path, LLAMA70B)), "-c", "h200-ndr")
    assert code == 0, err
    assert "does NOT fit partition 'h200'" in out
    assert "recommended on 'h200': 2 node(s)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("h200 ", "h200-debug "))]
    assert [row[:5] for row in rows] == [["h200", "h200", "141", "no", "16"], ["h200-debug", "h200", "141", "no", "16"]]


def test_plan_of_a_cpu_job_speaks_of_ranks_and_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "plan", str(REPO / "examples/tiny.yaml"), "-c", "local")
    assert code == 0, err
    assert "x 2 CPU ranks" in out and "memory per rank (host memory;" in out and "GPU" not in out
    assert "params           0.3 MiB" in out  # a small job's parts in MiB, not all "0.0 GiB"
    assert "time: not estimated for CPU ranks" in out


def test_plan_refuses_a_command_job(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "plan", str(REPO / "examples/command.yaml"))
    assert code == 2 and err.startswith("meshrun: error: command: ")


def test_a_preset_expands_and_explicit_keys_win(tmp_path: Path) -> None:
    path = write_spec(tmp_path, {"preset": "llama-7b", "seq_len": 2048})
    spec, _ = load_job(path)
    assert spec.trainer.model == Model(**{**LLAMA7B, "seq_len": 2048, "preset": "llama-7b"})
    # a preset given by --set replaces the file's model keys (only --set's own win over it)
    tiny, _ = load_job(REPO / "examples/tiny.yaml", ["train.model.preset=llama-70b", "train.model.seq_len=1024"])
    assert tiny.trainer.model == Model(**{**PRESETS["llama-70b"], "seq_len": 1024, "preset": "llama-70b"})


def test_plan_sizes_any_spec_with_a_preset_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", str(REPO / "examples/h100-8node.yaml"), "-c", "h100-ndr", "--json"]
    code, out, err = run(capsys, *argv, "--set", "train.model.preset=llama-70b")
    assert code == 0, err
    assert json.loads(out)["params"] == param_count(Model(**PRESETS["llama-70b"]))


def test_an_unknown_preset_is_one_line_with_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", str(REPO / "examples/tiny.yaml"), "--set", "train.model.preset=llama-7"]
    code, _, err = run(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "train.model.preset: 'llama-7': unknown preset (did you mean 'llama-7b'?); valid: gpt2-small," in err


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_model(name: str) -> None:
    model = Model(**PRESETS[name])
    assert model.d_model % model.n_heads == 0 and (model.d_model // model.n_heads) % 2 == 0
    assert model.vocab_size % 8 == 0 or name.startswith("llama-")  # tp up to 8 splits the vocabulary


def test_deepspeed_jobs_get_a_zero_stage_that_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """13B in ZeRO-0 keeps 16 bytes a parameter on every GPU (208 GB): refused, with a stage that fits."""
    path = write_spec(tmp_path, {"preset": "llama-13b"}, engine="deepspeed")
    text = path.read_text().replace("dp_mode: ddp", "zero: 0")
    path.write_text(text)
    code, _, err = run(capsys, "submit", str(path), "-c", "h100-ndr")
    assert code == 2 and "dp=8 tp=1 pp=1 zero=0" in err and "set parallel.zero=3" in err
    code, out, err = run(capsys, "plan", str(path), "-c", "h100-ndr", "--json")
    rec = json.loads(out)["recommended"]
    assert code == 0 and rec["zero"] == 3 and "dp_mode" not in rec


def test_a_model_that_fits_nowhere_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A million-token sequence: the last stage's logits alone (whole on every tp rank) outgrow any H100."""
    spec = str(write_spec(tmp_path, {**LLAMA7B, "seq_len": 1 << 20}, dp_mode="fsdp"))
    code, _, err = run(capsys, "submit", spec, "-c", "h100-ndr")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no layout fits any number of 'gpu' nodes (up to 64)" in err
    code, out, _ = run(capsys, "plan", spec, "-c", "h100-ndr", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["fits"] is False and plan["recommended"] is None and "gpus" not in plan["partitions"][0]


def test_the_python_api_refuses_what_cannot_fit_before_sending_anything(tmp_path: Path) -> None:
    """meshrun.submit.api.submit checks the fit as the CLI does (the transport is never used), unless force=True."""
    from meshrun.submit import api
    from meshrun.submit.config.cluster import load_profile
    from meshrun.submit.errors import InputError
    from meshrun.submit.planning.plan import plan_file

    plan = plan_file(write_spec(tmp_path, LLAMA70B), load_profile("h100-ndr"))

    class NoTransport:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the transport was used ({name}) before the fit check")

    with pytest.raises(InputError, match="needs .* per GPU"):
        api.submit(plan, registry=None, transport=NoTransport())  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="transport was used"):
        api.submit(plan, registry=None, transport=NoTransport(), force=True)  # type: ignore[arg-type]
