"""The precisions a recipe's `trainer.precision` may name, and the dtype each one runs in.

The one table of them: the recipe checks, the training, tuning and inference jobs (through
recipes.training.precision), the evaluation stage, the cost model and the AutoConfigurator all
read it. The names are NeMo's and Lightning's ("bf16-mixed", "32-true", ...) and the dtypes'
own; each means megatron-core's fp16 or bf16 mixed precision (fp32 main weights and
gradients) or plain fp32. Lightning's "-true" half precisions (no fp32 main weights) are not
here: the training program has no such mode.
"""

from __future__ import annotations

from typing import Any

from launcher_scripts.errors import ConfigError

# precision name -> the dtype of weights and activations: "bf16", "fp16" or "fp32"
PRECISIONS = {
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "fp16",
    "16-mixed": "fp16",
    "fp16": "fp16",
    "32": "fp32",
    "32-true": "fp32",
    "fp32": "fp32",
}


def dtype_of(value: Any, key: str) -> str:
    """The dtype `value` (a precision name, or a number such as 32) runs in; ConfigError
    naming `key` for a name not in PRECISIONS."""
    name = str(value)
    if name not in PRECISIONS:
        raise ConfigError(
            key, f"{name!r} is not a precision", f"Use one of: {', '.join(PRECISIONS)}"
        )
    return PRECISIONS[name]
