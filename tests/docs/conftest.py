"""The Slurm testbed's fixtures for the docs' cluster examples (tests/integration/conftest.py starts it)."""

from tests.integration.conftest import healthy_testbed, testbed  # noqa: F401 - fixtures, used by name
