"""Train a tuning stage's model a few steps in this process and report which tensors changed:

python -m tests.scripts.peft_frozen STAGE_HYDRA.yaml STAGE STEPS
prints one JSON line: counts of base and PEFT tensors, and the names of those that changed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.scripts.tuner_setup import built_tuner


def parameters(tuner: Any) -> dict[str, Any]:
    """A copy of every parameter of the tuner's model, by name."""
    return {n: p.detach().clone() for n, p in tuner.model[0].module.named_parameters()}


def frozen_report(tuner: Any, steps: int, before: dict[str, Any]) -> dict[str, Any]:
    """`steps` training steps of the tuner (its data built), then which tensors differ from
    `before` (its parameters when it was built)."""
    from launcher_scripts.jobs.fine_tuning.peft import is_peft_parameter

    model = tuner.model[0].module
    for _ in range(steps):
        tuner.train_step()
    changed = [n for n, p in model.named_parameters() if not p.detach().equal(before[n])]
    base_names = [n for n in before if not is_peft_parameter(n)]
    peft_names = [n for n in before if is_peft_parameter(n)]
    report = {
        "base_tensors": len(base_names),
        "peft_tensors": len(peft_names),
        "base_changed": [n for n in changed if n in base_names],
        "peft_changed": len([n for n in changed if n in peft_names]),
    }
    return report


def main() -> None:
    config, stage, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with built_tuner(config, stage) as tuner:
        before = parameters(tuner)
        tuner.prepare_data()
        report = frozen_report(tuner, steps, before)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
