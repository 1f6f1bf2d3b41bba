"""The torch side of each model family: what the training loop asks of the model it trains."""

from launcher_scripts.jobs.models.base import ModelRuntime, runtime_of

__all__ = ["ModelRuntime", "runtime_of"]
