"""Getting weights out: safetensors consolidation, the Hugging Face folder, the streaming writer."""
