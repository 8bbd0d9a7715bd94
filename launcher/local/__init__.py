"""The `local` cluster's node side, what sbatch + srun are on Slurm: the supervisor that runs a job's ranks on
this machine and the rank controller that records how each one ended. Torch-free."""
