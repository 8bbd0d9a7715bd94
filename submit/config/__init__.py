"""Configuration read from files: cluster profiles, the user's settings, strict YAML, shipped resources."""
