"""The built-in trainer: the loop, the Trainer, the GPT, its optimizer, parallelism, pipeline and metrics."""
