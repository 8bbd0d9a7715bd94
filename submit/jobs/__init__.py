"""Submitted jobs: the local registry, status, resume and export, secrets, the sidecars' findings, doctor."""
