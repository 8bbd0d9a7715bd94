"""Programs the planner and `meshrun doctor` run on the ranks: the preflight and the mesh dry run."""
