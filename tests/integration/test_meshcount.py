"""The mesh dry run (launcher/probes/meshcount.py, submit/planning/meshcheck.py): bytes per rank counted on the real model,
split by the real parallel code in a fake world, against hand-computed numbers and against the planner.

In-process counts (fake process groups, meta tensors: milliseconds each) except where the subprocess road
itself is under test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.launcher.contract.spec.job import JobSpec, Model, Parallel, Resources, Train
from meshrun.launcher.contract.spec.modelshape import StageBytes as PlannedBytes
from meshrun.launcher.contract.spec.schema import SchemaError, to_plain
from meshrun.launcher.probes import meshcount
from meshrun.launcher.probes.meshcount import Held, StageBytes
from meshrun.submit.errors import InputError
from meshrun.submit.planning import estimate, meshcheck

REPO = Path(__file__).resolve().parents[2]
TINY = Model(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
# By hand for TINY: ffn hidden ceil(2.6667*64/64)*64 = 192; a block's q,k,v,o 4*64*64 = 16384, SwiGLU
# 3*64*192 = 36864 (both split over tp), two norms 2*64 (whole on every tp rank); embedding and head
# 256*64 = 16384 each (split over tp), final norm 64.
MATRICES, NORMS, TABLE, D = 16384 + 36864, 128, 16384, 64
BLOCK = MATRICES + NORMS
WHOLE = TABLE + 4 * BLOCK + D + TABLE


def job(
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    mode: str = "fsdp",
    model: Model = TINY,
    gpus: int = 0,
    sp: bool = False,
    **train: object,
) -> JobSpec:
    world = dp * tp * pp
    resources = Resources(nodes=world // gpus, gpus_per_node=gpus) if gpus else Resources(nodes=1, tasks_per_node=world)
    parallel = {k: v for k, v in train.items() if k in ("zero", "offload_optimizer", "offload_params")}
    rest = {k: v for k, v in train.items() if k not in parallel}
    return JobSpec(
        name="mesh",
        resources=resources,
        parallel=Parallel(dp=dp, tp=tp, pp=pp, dp_mode=mode, sequence_parallel=sp, **parallel),  # type: ignore[arg-type]
        train=Train(model=model, global_batch=64, micro_batch=1, **rest),  # type: ignore[arg-type]
    )


def native(stage: int, elements: int) -> StageBytes:
    """The native engine's rule: fp32 params, fp32 grads of their size, AdamW's 2 fp32 states."""
    return StageBytes(stage, 4 * elements, 4 * elements, 8 * elements)


HAND = {
    # layout: per stage, the elements one rank holds
    "ddp dp8": (job(dp=8, mode="ddp"), [WHOLE]),
    "fsdp dp8": (job(dp=8), [WHOLE // 8]),
    "tp4": (job(tp=4), [(2 * TABLE + 4 * MATRICES) // 4 + 4 * NORMS + D]),
    "ddp dp2 x tp4 (replicate)": (job(dp=2, tp=4, mode="ddp"), [(2 * TABLE + 4 * MATRICES) // 4 + 4 * NORMS + D]),
    "pp4": (job(pp=4), [TABLE + BLOCK, BLOCK, BLOCK, BLOCK + D + TABLE]),
    # 3D: matrices split over tp then dp; norms whole over tp, split over dp (sequence parallel: the same)
    "3D dp2 tp2 pp2 sp": (
        job(dp=2, tp=2, pp=2, sp=True),
        [(TABLE + 2 * MATRICES) // 4 + 2 * NORMS // 2, (TABLE + 2 * MATRICES) // 4 + (2 * NORMS + D) // 2],
    ),
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_counts_match_the_hand_computed_bytes(name: str) -> None:
    spec, elements = HAND[name]
    assert meshcount.count(spec) == [native(s, n) for s, n in enumerate(elements)]


@pytest.mark.parametrize("name", ["fsdp dp8", "tp4", "3D dp2 tp2 pp2 sp", "pp4"])
def test_every_rank_of_a_stage_holds_what_its_representative_holds(name: str) -> None:
    """Why one rank per stage is enough: the stage's first and last ranks (other dp and tp coordinates)
    hold the same bytes when the sizes divide."""
    spec, _ = HAND[name]
    dims = meshcount.dims_of(spec)
    group = dims.dp * dims.tp
    for stage in range(dims.pp):
        first = meshcount.count_rank(spec, stage * group)
        assert meshcount.count_rank(spec, stage * group + group - 1) == first
        assert first.nbytes == meshcount.count(spec)[stage].params


def test_an_uneven_fsdp_split_counts_the_largest_shard() -> None:
    """dp 3 does not divide 256 or 64: FSDP2 pads every shard to the first's size, so rank 0's (the
    largest) is what each rank allocates, and what the count reports."""
    spec = job(dp=3)
    first, last = meshcount.count_rank(spec, 0), meshcount.count_rank(spec, 2)
    assert last.numel < first.numel
    assert meshcount.count(spec) == [native(0, first.numel)]
    # Every tensor's first dimension rounded up to a multiple of 3, then divided by 3.
    rows = [(256, 64), *[(64, 64)] * 16, *[(192, 64), (64, 192), (192, 64)] * 4, *[(64, 1)] * 9, (256, 64)]
    assert first.numel == sum(-(-r // 3) * c for r, c in rows)


P = WHOLE


@pytest.mark.parametrize(
    ("zero", "precision", "offload", "want"),
    [
        # fp32 (measured in bench/deepspeed.py): params, grads, Adam + the ZeRO-1/2 fp32 master partition
        (0, "fp32", {}, (4 * P, 4 * P, 8 * P)),
        (1, "fp32", {}, (4 * P, 4 * P, 8 * P // 4 + 4 * P // 4)),
        (2, "fp32", {}, (4 * P, 4 * P // 4, 8 * P // 4 + 4 * P // 4)),
        (3, "fp32", {}, (4 * P // 4, 4 * P // 4, 8 * P // 4)),
        # bf16: the ZeRO paper's 2 + 2 + 12 bytes per parameter
        (0, "bf16", {}, (2 * P, 2 * P, 12 * P)),
        (3, "bf16", {}, (2 * P // 4, 2 * P // 4, 12 * P // 4)),
        (3, "bf16", {"offload_optimizer": True, "offload_params": True}, (0, 2 * P // 4, 0)),
    ],
)
def test_deepspeed_counts_follow_the_zero_stage(
    zero: int, precision: str, offload: dict[str, bool], want: tuple[int, int, int]
) -> None:
    spec = job(dp=4, engine="deepspeed", zero=zero, precision=precision, **offload)
    assert meshcount.count(spec) == [StageBytes(0, *want)]


# ------------------------------------------------------------------ against the planner

SEVEN_B = Model(n_layers=32, d_model=4096, n_heads=32, vocab_size=32000, seq_len=4096, ffn_mult=2.6875)
LAYOUTS_64 = {
    "ddp": dict(dp=64, mode="ddp"),
    "fsdp": dict(dp=64),
    "tp": dict(dp=8, tp=8),
    "pp": dict(dp=8, pp=8),
    "3D": dict(dp=2, tp=8, pp=4),
    "3D ddp": dict(dp=2, tp=8, pp=4, mode="ddp"),
    "deepspeed ZeRO-1": dict(dp=64, engine="deepspeed", zero=1),
    "deepspeed ZeRO-3 + offload": dict(dp=64, engine="deepspeed", zero=3, offload_optimizer=True),
}


SMALL = Model(n_layers=8, d_model=128, n_heads=8, vocab_size=256, seq_len=64)


@pytest.mark.parametrize("name", sorted(LAYOUTS_64))
@pytest.mark.parametrize("model", [SMALL, SEVEN_B], ids=["small", "7B"])
def test_the_planner_agrees_with_the_mesh_count_within_1_percent(name: str, model: Model) -> None:
    spec = job(model=model, gpus=8, precision="bf16", **LAYOUTS_64[name])  # type: ignore[arg-type]
    counted = meshcount.count(spec)
    planned = estimate.model_state_bytes(spec)
    assert [p.stage for p in planned] == [c.stage for c in counted]
    for want, got in zip(counted, planned):
        for field in ("params", "grads", "optimizer"):
            mine, theirs = getattr(want, field), getattr(got, field)
            assert abs(theirs - mine) <= 0.01 * mine, f"stage {want.stage} {field}: planner {theirs}, mesh {mine}"


# ------------------------------------------------------------------ the subprocess road


def test_meshcheck_runs_the_count_in_the_jobs_interpreter_for_8192_ranks() -> None:
    """The submit side (torch-free) gets the same StageBytes from the subprocess, for a world of 8,192."""
    seventy_b = Model(n_layers=80, d_model=8192, n_heads=64, vocab_size=32000, seq_len=4096, ffn_mult=3.5)
    spec = job(dp=128, tp=8, pp=8, model=seventy_b, gpus=8, precision="bf16")
    stages = meshcheck.run(spec)
    assert [s.stage for s in stages] == list(range(8))
    # A middle stage: 10 blocks, matrices over tp x dp = 1024 ranks, the two norms over dp = 128.
    matrices, norms = 4 * 8192 * 8192 + 3 * 8192 * 28672, 2 * 8192
    per_rank = 10 * (matrices // 1024 + norms // 128)
    assert stages[3] == PlannedBytes(3, 4 * per_rank, 4 * per_rank, 8 * per_rank)  # the planner's type
    assert stages[0].params > stages[3].params < stages[7].params  # the embedding, the head


def test_bad_input_is_one_line_and_exit_2() -> None:
    bad = to_plain(job(dp=2))
    bad["parallel"]["dp"] = 3  # 3 ranks asked, 2 started
    done = subprocess.run(
        [sys.executable, "-m", "meshrun.launcher.probes.meshcount"],
        input=json.dumps(bad),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "meshcount: error: parallel: 'dp=3 tp=1 pp=1': dp(3)*tp(1)*pp(1)"
    )
    garbage = subprocess.run(
        [sys.executable, "-m", "meshrun.launcher.probes.meshcount"], input="{", capture_output=True, text=True, cwd=REPO
    )
    assert garbage.returncode == 2 and garbage.stderr.count("\n") == 1, garbage


def test_meshcheck_raises_the_counters_bad_input_as_an_input_error() -> None:
    with pytest.raises(InputError) as caught:
        meshcheck.run(job(tp=8))  # 4 heads over tp 8: refused by the counter's layout check
    assert caught.value.key == "parallel.tp" and caught.value.value == 8
    with pytest.raises(SchemaError):
        meshcount.count(JobSpec(name="cmd", command=("true",)))
    with pytest.raises(SchemaError, match="train.model.d_model: 68: must split into n_heads"):
        meshcount.count(job(model=Model(n_layers=4, d_model=68, n_heads=4, vocab_size=256, seq_len=32)))


def test_held_is_what_the_rank_sees() -> None:
    assert meshcount.count_rank(job(), 0) == Held(WHOLE, 4 * WHOLE)


def test_plan_mesh_summary_sets_the_count_beside_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """`meshrun plan --mesh`'s object and lines: per stage the counted bytes, the planner's, the difference;
    a planner 2% off is called out."""
    spec = job(dp=2, tp=2, pp=2)
    mesh = meshcheck.summary(spec)
    assert mesh["agrees"] and mesh["world_size"] == 8
    assert [row["params"] for row in mesh["stages"]] == [s.params for s in meshcount.count(spec)]
    assert all(abs(row["difference"]) <= 0.01 for row in mesh["stages"])
    assert "agrees with the plan" in meshcheck.lines(mesh)[0]

    def off(spec: JobSpec) -> list[PlannedBytes]:
        return [PlannedBytes(s.stage, s.params, s.grads, int(s.optimizer * 0.98)) for s in meshcount.count(spec)]

    monkeypatch.setattr(estimate, "model_state_bytes", off)
    mesh = meshcheck.summary(spec)
    assert not mesh["agrees"] and mesh["stages"][0]["difference"] == pytest.approx(-0.02, abs=1e-4)
    text = "\n".join(meshcheck.lines(mesh))
    assert "DIFFERS from the plan" in text and "-2.00%" in text, text


def test_meshrun_plan_mesh_through_the_cli(tmp_path: Path) -> None:
    """The real verb: the example 64-GPU job, `meshrun plan --mesh` (text and --json), and a layout error."""
    from tests.helpers.cli import meshrun

    spec = str(REPO / "examples" / "h100-8node.yaml")
    out = meshrun(tmp_path, "plan", spec, "-c", "h100-ndr", "--mesh", "--json", check=True)
    mesh = json.loads(out.stdout)["mesh"]
    assert mesh["world_size"] == 64 and mesh["agrees"], mesh
    # 24 blocks + embedding + head over tp 4 (norms whole), then fsdp over dp 16: fp32
    d, v, hidden = 2048, 50304, 5504
    elements = (24 * (4 * d * d + 3 * d * hidden) + 2 * v * d) // 64 + (24 * 2 * d + d) // 16
    assert mesh["stages"] == [
        {
            "stage": 0,
            "params": 4 * elements,
            "grads": 4 * elements,
            "optimizer": 8 * elements,
            "planned": {"params": 4 * elements, "grads": 4 * elements, "optimizer": 8 * elements},
            "difference": 0.0,
        }
    ]
    text = meshrun(tmp_path, "plan", spec, "-c", "h100-ndr", "--mesh", check=True).stdout
    assert "mesh dry run (64 ranks, real model split in a fake world" in text and "agrees with the plan" in text
    bad = meshrun(tmp_path, "plan", spec, "-c", "h100-ndr", "--mesh", "--set", "parallel.tp=3")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "parallel" in bad.stderr, bad


# k/v 256 rows wide: FSDP2 pads dim 0 to a multiple of dp (64), which narrower ones would show as a difference
GQA_TIED = Model(n_layers=4, d_model=512, n_heads=16, n_kv_heads=8, tie_embeddings=True, vocab_size=256, seq_len=64)
GQA_70B = Model(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, vocab_size=32000, seq_len=4096, ffn_mult=3.5)


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (GQA_TIED, "fsdp"),
        (GQA_TIED, "tp"),
        (GQA_TIED, "ddp"),
        (GQA_TIED, "deepspeed ZeRO-1"),
        (GQA_70B, "3D"),
        (GQA_70B, "tp"),
    ],
)
def test_gqa_and_a_tied_head_count_as_the_planner_says(model: Model, name: str) -> None:
    """The real parallel code splits the narrower k/v over tp (whole kv heads per rank) and holds the tied
    head once (re-tied to the embedding's shard under tp): the planner's arithmetic is the same."""
    spec = job(model=model, gpus=8, precision="bf16", **LAYOUTS_64[name])  # type: ignore[arg-type]
    counted, planned = meshcount.count(spec), estimate.model_state_bytes(spec)
    for want, got in zip(counted, planned):
        assert abs(got.params - want.params) <= 0.001 * want.params, (want, got)
