"""A rank's start: where it stands (rank, world, node, master address; Slurm's hostlist), the stop flag its
signal handlers set, its first fatal error as one line, and the entry that trains or runs the user's program.
Torch-free at import time (the training code is imported by the entry when it runs)."""
