"""data_curation's preparation: what a step needs made once before the document pass (the
task n-gram index of decontamination, a trained quality classifier).

    python3 -m launcher_scripts.jobs.curation.prepare --config STAGE.yaml
"""

from __future__ import annotations

import sys

from launcher_scripts.jobs.curation.work import load_recipe, run_units


def prepare(config: str, _unit: int) -> str:
    _cfg, recipe = load_recipe(config)
    names = []
    for step, section in recipe.prepared_steps():
        assert step.prepare is not None
        step.prepare(section, recipe.work_dir)
        names.append(step.name)
    return f"prepared: {', '.join(names)}"


def main(argv: list[str] | None = None) -> int:
    # Always redone (no unit marker): it is quick, and its inputs may have changed.
    return run_units(
        argv,
        "data_curation's preparation of the steps that need it",
        lambda recipe: 1,
        None,  # redone each time
        prepare,
    )


if __name__ == "__main__":
    sys.exit(main())
