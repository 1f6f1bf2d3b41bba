"""Conversion of training checkpoints: the portable file, the Hugging Face export, loading."""
