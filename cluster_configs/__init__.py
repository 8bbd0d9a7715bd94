"""Shipped cluster profiles, installed as the data package `meshrun.cluster_configs` (see submit/config/resources.py)."""
