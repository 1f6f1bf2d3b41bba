"""lm-eval through our adapter next to a direct computation, on one layout:

python -m tests.scripts.eval_check MODEL.nemo OUT.json TP PP BATCH      (TP x PP processes)

Every rank runs the offline tasks through MegatronLM, then recomputes each request directly
(one request per `runner.logits` call, no sorting, no padding, no truncation helpers); rank 0
writes both to OUT.json with the tasks' metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from launcher_scripts.jobs.evaluation.evaluate import configure_hub
from launcher_scripts.recipes.evaluation import OFFLINE_TASKS, TASK_DIR


def direct_pair(runner: Any, context: str, continuation: str) -> tuple[float, bool]:
    """log P(continuation | context): the pair encoded as one text, the model run on all of it
    but the last token, the continuation's tokens read off the last positions."""
    tokenizer = runner.tokenizer
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    assert 0 < start < len(whole) <= runner.max_length, (context, continuation)
    logprobs = torch.log_softmax(runner.logits([whole[:-1]])[0], dim=-1)
    target = torch.tensor(whole[start:])
    rows = logprobs[start - 1 : len(whole) - 1]
    picked = rows.gather(-1, target.unsqueeze(-1)).double().sum().item()
    return picked, bool((rows.argmax(-1) == target).all())


def direct_document(runner: Any, text: str) -> tuple[float, int]:
    """log P(document), its first token conditioned on EOD. A document longer than the model's
    M positions is taken in chunks of M tokens, each chunk's tokens predicted from the M tokens
    before the chunk's end. Returns the log-prob and the number of tokens."""
    tokens = runner.tokenizer.encode(text)
    padded = [runner.tokenizer.eod_id, *tokens]  # padded[i] precedes tokens[i]
    m, total = runner.max_length, 0.0
    for start in range(0, len(tokens), m):
        end = min(start + m, len(tokens))
        inputs = padded[max(0, end - m) : end]
        logprobs = torch.log_softmax(runner.logits([inputs])[0], dim=-1)
        scored = logprobs[len(inputs) - (end - start) :]
        picked = scored.gather(-1, torch.tensor(tokens[start:end]).unsqueeze(-1))
        total += picked.double().sum().item()
    return total, len(tokens)


def main() -> None:
    model_file, output = Path(sys.argv[1]), Path(sys.argv[2])
    tensor, pipeline, batch = (int(a) for a in sys.argv[3:6])
    configure_hub()
    import torch.distributed as dist
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    from launcher_scripts.jobs.evaluation.lm_adapter import MegatronLM
    from launcher_scripts.jobs.inference.runner import close_runner, open_runner

    runner = open_runner(model_file, tensor, pipeline, on_gpu=False)
    manager = TaskManager(include_path=[str(TASK_DIR)], include_defaults=False)
    results = simple_evaluate(
        model=MegatronLM(runner, batch, progress=False),
        tasks=list(OFFLINE_TASKS),
        num_fewshot=0,
        bootstrap_iters=0,
        log_samples=True,
        task_manager=manager,
    )
    # simple_evaluate answers on LOCAL_RANK 0 only: every rank needs the requests, so rank 0
    # shares them (the direct computation is collective too).
    samples = [results["samples"] if results else None]
    dist.broadcast_object_list(samples, src=0)
    checked: dict[str, list[dict[str, Any]]] = {}
    for task, rows in samples[0].items():
        checked[task] = []
        for row in rows:
            entry: dict[str, Any] = {"adapter": row["resps"]}
            if task == "tiny_wikitext":
                entry["direct"], entry["tokens"] = direct_document(runner, row["arguments"][0][0])
            elif task != "tiny_generate":
                entry["direct"] = [direct_pair(runner, *pair) for pair in row["arguments"]]
            checked[task].append(entry)
    if dist.get_rank() == 0:
        metrics = {task: results["results"][task] for task in OFFLINE_TASKS}
        output.write_text(json.dumps({"samples": checked, "metrics": metrics}, default=str))
    close_runner()


if __name__ == "__main__":
    main()
