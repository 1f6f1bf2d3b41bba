"""Fine-tuning and parameter-efficient tuning of GPT models."""
