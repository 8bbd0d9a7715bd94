"""Fault injection for tests and drills: kept apart from the product code that calls it."""
