"""The per-node sidecar: `python -m meshrun.launcher.sidecar RUN_DIR`. Torch-free; reads and writes files only.

One per node (the batch script starts it with `srun --overlap`, the local supervisor starts one per
job). It samples GPU telemetry through NVML (keyed by GPU UUID, mapped to the job's
CUDA_VISIBLE_DEVICES and local ranks) and the host's CPU, memory and disk I/O from /proc, writes
them to RUN_DIR/gpu.jsonl and to TensorBoard (RUN_DIR/tensorboard/sidecar-NODE/), and records the
node's environment (driver, CUDA, torch, NCCL, meshrun) in RUN_DIR/env/NODE.json, warning when
nodes differ. It never fails the job: an error is one line in RUN_DIR/logs/sidecar-NODE.log.

    nvml.py       GPU discovery, CUDA_VISIBLE_DEVICES -> UUIDs, one sample per GPU, XID events
    host.py       CPU, memory and disk I/O from /proc
    envrecord.py  the environment record; env_mismatches() lives in launcher/contract/records/envcheck.py (status shows it)
    loop.py       the main loop: periodic tasks (sampling, the env check; hang watch and checkpoint
                  copier plug in as further tasks), stop on SIGTERM or when the parent is gone
"""

from __future__ import annotations
