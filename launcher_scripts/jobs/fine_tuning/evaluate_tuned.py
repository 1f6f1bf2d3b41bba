"""Evaluation of a tuned GPT: `python -m launcher_scripts.jobs.fine_tuning.evaluate_tuned
--config F` (the evaluation stage's resolved recipe with `evaluation_kind: fine_tuned`).

The model is a base portable file plus a PEFT file (`peft_model_file`, `adapter_model_file` or
`virtual_prompt_model_file`), or a fully fine-tuned portable file (`restore_from_path`), built
at the recipe's TP x PP. Each test record's prompt is answered by generation with the recipe's
`inference` settings; exact match and SQuAD-style token F1 against the record's answers (its
`output`, plus any `original_answers`) go to results.json and results.md, and every answer to
`pred_file_path` as JSON lines.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import string
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher_scripts.recipes.tuned_evaluation import model_file_of, peft_file_of


def normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, articles or extra spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction: str, answer: str) -> float:
    predicted, truth = normalize(prediction).split(), normalize(answer).split()
    common = sum((collections.Counter(predicted) & collections.Counter(truth)).values())
    if not predicted or not truth:
        return float(predicted == truth)
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(truth)
    return 2 * precision * recall / (precision + recall)


def scores(prediction: str, answers: list[str]) -> dict[str, float]:
    return {
        "exact_match": max(float(normalize(prediction) == normalize(a)) for a in answers),
        "f1": max(token_f1(prediction, a) for a in answers),
    }


def data_section(cfg: DictConfig, stored: dict[str, Any]) -> dict[str, Any]:
    """The SftFormat keys: the recipe's data section, filled from what the PEFT file recorded."""
    data = cfg.data
    return {
        "prompt_template": data.get("prompt_template") or stored.get("prompt_template"),
        "context_key": data.get("context_key") or "input",
        "label_key": data.get("label_key") or stored.get("label_key") or "output",
        "max_seq_length": data.get("max_seq_length") or 2048,
        "truncation_field": "context",
        "add_eos": False,  # the prompt is what matters here
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the evaluation stage's resolved YAML")
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig)
    import torch

    from launcher_scripts.files import write_atomic
    from launcher_scripts.jobs.fine_tuning import peft, peft_file, sft_data
    from launcher_scripts.jobs.fine_tuning.answers import prompt_logits, write_jsonl
    from launcher_scripts.jobs.inference.generation import generate
    from launcher_scripts.jobs.inference.runner import InferenceError, close_runner, open_runner
    from launcher_scripts.jobs.training.init_weights import load_full_tensors
    from launcher_scripts.recipes.generation_params import GenerationParams

    model = cfg.model
    on_gpu = str(cfg.run.accelerator) != "cpu" and torch.cuda.is_available()
    tensor, pipeline = (
        int(model.tensor_model_parallel_size),
        int(model.pipeline_model_parallel_size),
    )
    try:
        runner = open_runner(model_file_of(model), tensor, pipeline, on_gpu)
    except (InferenceError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    try:
        stored: dict[str, Any] = {}
        virtual = 0
        tuned = peft_file_of(model)
        if tuned is not None:
            loaded = peft_file.read(tuned)
            chunks = runner.chunks
            attached = peft.attach(chunks, loaded.settings, chunks[0].config)
            if on_gpu:
                for module in attached.modules:
                    module.cuda(torch.cuda.current_device())
            load_full_tensors(chunks, loaded.tensors, wanted=peft.is_peft_key)
            for chunk in chunks:
                chunk.eval()
            stored = OmegaConf.to_container(loaded.config.get("data") or {}, resolve=True)  # type: ignore[assignment]
            virtual = loaded.settings.virtual_tokens
            if model.get("disable_special_tokens"):
                attached.remove()
                virtual = 0
        fmt = sft_data.SftFormat.from_section(
            data_section(cfg, stored), "evaluation.data", True, virtual
        )
        files = [Path(str(p)) for p in cfg.data.test_ds]
        loaded_files, report = sft_data.load_files(files, runner.tokenizer, fmt, "test data")
        if report:
            print(report, flush=True)
        records = [r for f in loaded_files for r in f.records if r.prompt]
        inference = cfg.inference
        params = GenerationParams(
            tokens_to_generate=int(inference.tokens_to_generate),
            top_k=1 if inference.get("greedy", True) else int(inference.get("top_k") or 0),
            top_p=0.0 if inference.get("greedy", True) else float(inference.get("top_p") or 0),
            temperature=float(inference.get("temperature") or 1.0),
            repetition_penalty=float(inference.get("repetition_penalty") or 1.0),
        )
        logits = prompt_logits(runner, [runner.tokenizer.eod_id] * virtual)

        batch_size = int(model.get("eval_batch_size") or 1)
        rows = []
        for start in range(0, len(records), batch_size):
            batch = records[start : start + batch_size]
            outputs = generate(
                logits,
                runner.tokenizer,
                [r.prompt for r in batch],
                params,
                max_length=runner.max_length - virtual,
            )
            for record, output in zip(batch, outputs, strict=True):
                rows.append(
                    {
                        "input": record.prompt,
                        "pred": output.text.strip(),
                        "answers": record.answers,
                        **scores(output.text.strip(), record.answers),
                    }
                )
        results = {
            "exact_match": 100 * sum(r["exact_match"] for r in rows) / len(rows),
            "f1": 100 * sum(r["f1"] for r in rows) / len(rows),
            "samples": len(rows),
        }
        import torch.distributed as dist

        if dist.get_rank() == 0:
            results_dir = Path(str(cfg.run.results_dir))
            pred_file = Path(
                str(cfg.data.get("pred_file_path") or results_dir / "predictions.jsonl")
            )
            write_jsonl(pred_file, rows)
            write_atomic(results_dir / "results.json", json.dumps(results, indent=2) + "\n")
            table = "| metric | value |\n|---|---|\n" + "".join(
                f"| {k} | {v:.2f} |\n" for k, v in results.items() if k != "samples"
            )
            write_atomic(results_dir / "results.md", table + f"\n{len(rows)} samples\n")
            print(
                f"exact_match {results['exact_match']:.2f}, f1 {results['f1']:.2f} over "
                f"{len(rows)} samples; predictions: {pred_file}",
                flush=True,
            )
        return 0
    except (sft_data.SftDataError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        close_runner()


if __name__ == "__main__":
    sys.exit(main())
