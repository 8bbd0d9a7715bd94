"""The checkpoint verbs: `meshrun resume JOB [--wait]` and
`meshrun export JOB -o OUT [--step N | --best] [--format meshrun|hf] [--max-shard-size 5GB]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshrun.submit.cli.args import overrides_arg, positive_int
from meshrun.submit.errors import InputError


def add_parsers(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = verbs.add_parser(
        "resume",
        help="continue a stopped, failed or killed job from its newest complete checkpoint, in the same run dir",
    )
    p.add_argument("job")
    p.add_argument("--wait", action="store_true", help="wait for the end; exit 0 only if it succeeded")
    overrides_arg(
        p,
        "change what may change on a resume (train.steps, the lr schedule, cadences, checkpoint.max_requeues); "
        "repeatable",
    )
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")

    p = verbs.add_parser(
        "export", help="write a job's checkpoint as one safetensors file, or a Hugging Face Llama folder (--format hf)"
    )
    p.add_argument("job")
    p.add_argument(
        "-o", "--output", type=Path, required=True, help="the .safetensors file to write (--format hf: the folder)"
    )
    p.add_argument(
        "--format",
        choices=("meshrun", "hf"),
        default="meshrun",
        help="meshrun: one file in meshrun's names; hf: a folder LlamaForCausalLM.from_pretrained loads "
        "(config.json, sharded safetensors, the tokenizer)",
    )
    p.add_argument(
        "--max-shard-size", default=None, help="--format hf: the largest safetensors file (default 5GB; e.g. 500MB)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=positive_int, help="this checkpoint step (default: the newest complete one)")
    which.add_argument(
        "--best",
        action="store_true",
        help="the checkpoint with the lowest validation loss (checkpoint.keep_best keeps it)",
    )
    p.add_argument("-c", "--cluster", help="the job's cluster, if the id is ambiguous")


def cmd_resume(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.cli.common import finish_wait
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.core.runspec import read_run_spec
    from meshrun.submit.jobs import checkpoints

    registry = Registry()
    record = registry.find(args.job, args.cluster)
    clusters = api.Clusters()
    try:
        transport = clusters.transport_for(record)
        status = api.statuses([record], clusters, registry)[0]
        new = api.resume(record, transport, registry, status, args.overrides)
        print(f"resumed job {record.job_id} as job {new.job_id} on {new.cluster}")
        print(f"run dir: {new.run_dir}")
        note = checkpoints.resume_note(new, transport, parent=record)  # the saves are the parent's
        if note:
            print(note)
        if not args.wait:
            return 0
        spec = read_run_spec(new, transport).job
        return finish_wait(new, clusters, registry, total_steps=None if spec.command else spec.trainer.steps)
    finally:
        clusters.close()


def shard_size(given: str | None, fmt: str) -> str:
    """--max-shard-size, which only the hf format shards by (the meshrun format is one file)."""
    if given is not None and fmt != "hf":
        raise InputError("--max-shard-size", given, "only --format hf is sharded: add --format hf, or drop it")
    return given or "5GB"


def cmd_export(args: argparse.Namespace) -> int:
    from meshrun.submit import api
    from meshrun.submit.core.registry import Registry
    from meshrun.submit.jobs import checkpoints

    max_shard_size = shard_size(args.max_shard_size, args.format)  # before the registry: a flag's mistake first
    record = Registry().find(args.job, args.cluster)
    clusters = api.Clusters()
    try:
        transport = clusters.transport_for(record)
        tty = sys.stderr.isatty()
        ckpt = checkpoints.export(
            record,
            transport,
            clusters.profile_for(record),
            args.output,
            args.step,
            progress=(lambda line: print(f"\r{line}", end="", file=sys.stderr)) if tty else (lambda line: None),
            best=args.best,
            fmt=args.format,
            max_shard_size=max_shard_size,
        )
        note = None if args.step is not None or args.best else checkpoints.export_note(record, transport, ckpt)
    finally:
        clusters.close()
    print(f"wrote {args.output} from {ckpt}")
    if note:
        print(note)
    return 0
