"""The job spec and its schema, the one contract of what a job is: spec.json's types (job.py), the strict schema
that reads them (schema.py), and what is derived from a spec alone (the DeepSpeed config, the model's shape and
Hugging Face names, token files, initial weights, the layout check, presets, secrets). Torch-free; it names no
run-dir file but its own: the run-dir records (contract/records/) read the spec, never the other way."""

SPEC_FILE = "spec.json"
"""A run dir's spec file (RunDir.SPEC): the job as planned plus the run info."""
