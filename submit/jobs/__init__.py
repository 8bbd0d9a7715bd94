"""Submitted jobs, after the submit: their checkpoints (list, choose, export, resume's pick), doctor's checks of
a cluster's nodes, the suspect-node ledger. Nothing here looks a scheduler up: the API hands in what it needs."""
