"""The torch-free contract both sides share: all that `submit` may import of `launcher`.

Importing any module here imports neither torch nor numpy nor submitit (tests/unit/test_layout.py checks
each file); the folder is the list that the layout test, mypy (pyproject.toml) and docs/architecture.md read.
"""
