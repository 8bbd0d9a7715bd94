"""Training data on the ranks, and `meshrun data`'s corpus builder: dataset, tokenizers, text sources."""
