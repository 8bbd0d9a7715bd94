"""Export's peak memory against the model's size: streamed (today's export) and whole (the model in memory).

    .venv/bin/python bench/export_memory.py [--params-m 500] [--dir DIR] [--quick]

Writes a DCP checkpoint of a GPT-shaped model (random fp32 weights, committed like the trainer's), then
exports it in a fresh process per way, each measuring its own peak resident memory above what it held
after its imports (VmHWM after /proc/self/clear_refs; ru_maxrss where that is refused):
- `meshrun` and `hf` formats, streamed: DCP partial loads of at most shardwriter.HOLD_BYTES (64 MiB) at
  a time, written as they come;
- the whole model: every tensor loaded at once, then written (what export did before it streamed), the
  baseline that shows the measurement sees a model-sized allocation.
Prints each peak and its ratio to the model's bytes (goal for the streamed ways: well below 1, and
falling as the model grows). --quick: ~40 M parameters (160 MB, still 2.5x the streamed hold), what CI runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshrun.launcher.contract.records import ckptdir
from meshrun.launcher.contract.spec import hfnames, schema
from meshrun.launcher.contract.spec.job import Data, JobSpec, Model, Train

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, resource, sys
from pathlib import Path
import torch
from meshrun.launcher.export import consolidate
from meshrun.launcher.export import run as export

def rss_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

try:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    base = rss_kib("VmRSS")
except OSError:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the imports' peak: a lower bound
how, src, out = sys.argv[1:4]
if how == "whole":
    from safetensors.torch import save_file
    source = consolidate.load_newest(Path(src))
    save_file(source.load(list(source.dtypes)), out, metadata=source.metadata())
else:
    assert export.main([src, out, "--format", how]) == 0
print(json.dumps({"peak_kib": max(rss_kib("VmHWM"), 0) - base}))
"""


def shape_for(params_m: float) -> Model:
    """A Llama-shaped model of about `params_m` million parameters: many mid-sized tensors, as real ones."""
    d, layers = 1024, 1
    cfg = Model(n_layers=layers, d_model=d, n_heads=16, n_kv_heads=4, vocab_size=8192)
    while sum(_numel(s) for s in hfnames.meshrun_shapes(cfg).values()) < params_m * 1e6:
        layers += 1
        cfg = Model(n_layers=layers, d_model=d, n_heads=16, n_kv_heads=4, vocab_size=8192)
    return cfg


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def write_checkpoint(root: Path, cfg: Model) -> int:
    """A complete checkpoint of `cfg` under `root` (model tensors only: what export reads); its bytes."""
    job = JobSpec(name="export-memory", train=Train(model=cfg), data=Data(path="/nonexistent/tokens.u16"))
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in hfnames.meshrun_shapes(cfg).items()}
    tmp = ckptdir.step_dir(root, 1).with_suffix(".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
    marker = {"step": 1, "job": {k: v for k, v in schema.to_plain(job).items() if k != "env"}}
    ckptdir.commit(tmp, ckptdir.step_dir(root, 1), marker)
    return sum(t.numel() * t.element_size() for t in state.values())


def peak_kib(how: str, root: Path, out: Path) -> int:
    """The export's peak resident memory above its post-import level, in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, str(root), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_kib"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=500.0, help="model size in millions of parameters")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="~40 M parameters (CI's run)")
    args = parser.parse_args()
    cfg = shape_for(40.0 if args.quick else args.params_m)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "checkpoints"
        size = write_checkpoint(root, cfg)
        print(
            f"model: {size / 1e6:.0f} MB fp32 ({size / 4e6:.1f} M parameters, {cfg.n_layers} layers, d {cfg.d_model})"
        )
        for how, label in (
            ("meshrun", "streamed, meshrun"),
            ("hf", "streamed, hf     "),
            ("whole", "whole model      "),
        ):
            out = Path(tmp) / f"out-{how}" if how == "hf" else Path(tmp) / f"out-{how}.safetensors"
            peak = peak_kib(how, root, out) * 1024
            print(f"export {label}: peak +{peak / 1e6:.0f} MB, ratio peak/model {peak / size:.2f}")


if __name__ == "__main__":
    main()
