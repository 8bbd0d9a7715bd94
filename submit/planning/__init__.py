"""Planning: spec + profile -> a validated job, its memory, step time, layout search, sweeps, mesh check."""
