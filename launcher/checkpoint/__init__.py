"""Checkpoints: the manager (when to save, what to resume from), the commit, the resume guard."""
