"""What a run dir records, as both sides read it: every file's name (rundir.py), checkpoints and their
completeness, goodput, energy, alerts, the suspect-node ledger, stops and finishes, log times, the nodes'
environments. Torch-free; records may read the spec (contract/spec/), which never reads them."""
