"""Batch-script templates (Jinja2), installed as the data package `meshrun.templates` (see submit/config/resources.py)."""
