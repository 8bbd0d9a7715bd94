"""What the tests share, not tests themselves (pytest collects nothing here):

- builders.py: what many tests build alike: a hostile string for injection tests, a registry record, a plan.
- cli.py: runs the real `meshrun` command in a private home, as a user would (submit, status, wait for a state).
- ranks.py: launches real ranks the way torchrun does (`python -m meshrun.launcher RUN_DIR` per rank, over gloo).
- sshbed.py: the Slurm testbed reached only over SSH: a cluster profile, a user project, sshd's record of logins.
- tbhelp.py: what the TensorBoard tests share: a second real Unix user, a browser that keeps the board's
  cookie, stopping every server a test started.

Scripts that tests run as separate processes stay beside those tests (tests/integration/ds_probe.py, ...).
"""
