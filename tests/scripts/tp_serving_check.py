"""The in-flight loop served by a TP/PP group (jobs/inference/broadcast_cache.py): rank 0 takes
requests from several threads and schedules; the other ranks repeat its cache calls. Prints
rank 0's answers as one JSON object for tests/test_engine_loop.py:

python -m tests.scripts.tp_serving_check MODEL.nemo TP PP        (under torchrun for TP x PP > 1)
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from launcher_scripts.jobs.inference.broadcast_cache import Leader, follow
from launcher_scripts.jobs.inference.engine_loop import EngineLoop
from launcher_scripts.jobs.inference.generation import GenerationParams
from launcher_scripts.jobs.inference.runner import close_runner, open_runner
from tests.scripts.engine_loop_check import from_threads

REQUESTS = [
    (["The history of", "A"], GenerationParams(tokens_to_generate=20, top_k=1)),
    (["In the morning the river was"], GenerationParams(tokens_to_generate=8, beam_width=3)),
    (["We like"], GenerationParams(tokens_to_generate=16, top_k=20, random_seed=5)),
    (["Every winter", "The"], GenerationParams(tokens_to_generate=12, top_k=1)),
]


def main() -> None:
    tensor, pipeline = int(sys.argv[2]), int(sys.argv[3])
    runner = open_runner(sys.argv[1], tensor, pipeline, on_gpu=False)
    try:
        if dist.get_rank() != 0:
            follow(runner)
            return
        leader = Leader(runner)
        loop = EngineLoop(leader, runner.tokenizer, slots=8, positions=runner.max_length)
        answers = from_threads(loop, REQUESTS)
        loop.close()
        leader.stop()
        print(json.dumps(answers))
    finally:
        close_runner()


if __name__ == "__main__":
    main()
