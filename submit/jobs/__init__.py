"""Submitted jobs: their state (meshrun's own type), the local registry, status, resume and export, secrets, the
sidecars' findings, doctor. Nothing here looks a scheduler up: the API hands status and resume their backend."""
