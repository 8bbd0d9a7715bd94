"""meshrun's rank side: runs on every rank; never imports `submit` or paramiko.

Importing this package is cheap and torch-free; the torch code lives in
modules that only the ranks import (train, model, data).
"""
