"""Batch-script templates (Jinja2), installed as the data package `submit.templates` (see submit/config/resources.py)."""
