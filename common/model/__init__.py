"""The model: the Llama family, weights and their names, model files, the runner (KV cache, rows ->
logits),
CUDA graphs."""
