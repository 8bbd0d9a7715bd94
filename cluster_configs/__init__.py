"""Shipped cluster profiles, installed as the data package `submit.cluster_configs` (see submit/config/resources.py)."""
