"""What every room of submit shares about a job, below planning, schedulers and jobs (as submitit's core/ is below
its backends), so that none of the three imports another: the plan it is submitted from, its registry record and
meshrun's own state type, the status a backend reports, the findings read from its run dir, its secrets."""
