"""Evaluation of a portable model with lm-evaluation-harness, at any TP/PP."""
