"""The `meshrun` command: one module per verb group; main.py parses and dispatches."""
