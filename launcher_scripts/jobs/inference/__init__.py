"""Running a trained model: its tokenizer as text in and text out, batched logits at any TP/PP,
and generation. Shared by evaluation, the Triton model and the benchmarks."""
