"""Settings that go by several names: one stage's recipes name a setting otherwise than
another's, or than NeMo or Lightning do (a job's node count is `trainer.num_nodes` in a training
recipe and `run.node_array_size` in data preparation's). A key that no program reads gets "use
<the name here> instead" when its section has the same setting under another name.

Keys NeMo documents that this launcher refuses with a message of their own are in nemo_keys,
which is asked first.
"""

from __future__ import annotations

from collections.abc import Collection

# Each group: the names of one setting, within a stage's section; a section's name for it is
# the first of the group that the section has.
EQUIVALENT_KEYS: tuple[tuple[str, ...], ...] = (
    # the nodes a job runs on (data preparation: the array's tasks, one node each)
    (
        "trainer.num_nodes",
        "run.node_array_size",
        "run.nodes",
        "run.num_nodes",
        "nodes",
        "num_nodes",
        "trainer.nodes",
    ),
    # the processes (GPUs) a training job runs per node
    ("trainer.devices", "trainer.gpus", "run.ntasks_per_node", "run.devices", "devices", "gpus"),
    # data preparation's processes per node
    ("run.workers_per_node", "run.ntasks_per_node", "ntasks_per_node", "workers_per_node"),
    # the job's time limit
    ("run.time_limit", "run.time", "time_limit", "trainer.time_limit"),
    # CPU or GPU
    ("trainer.accelerator", "run.accelerator", "accelerator"),
)


def equivalent(path: str, known: Collection[str]) -> str | None:
    """The name among `known` (a section's dotted keys) of the setting that `path`, which the
    section lacks, names elsewhere; None when there is none."""
    for names in EQUIVALENT_KEYS:
        if path in names:
            found = next((name for name in names if name != path and name in known), None)
            if found is not None:
                return found
    return None
