"""Evaluation of a tuned model: `python -m launcher_scripts.jobs.fine_tuning.evaluate_tuned
--config F` (the evaluation stage's resolved recipe with `evaluation_kind: fine_tuned`).

The model is a base portable file plus a PEFT file (`peft_model_file`, `adapter_model_file` or
`virtual_prompt_model_file`), or a fully fine-tuned portable file (`restore_from_path`), built
at the recipe's TP x PP; its family (GPT, T5) says how a record becomes a prompt and how the
model answers it. Each test record's prompt is answered by generation with the recipe's
`inference` settings; exact match and SQuAD-style token F1 against the record's answers (its
`output` plus any `original_answers`, or a text-to-text target line) go to results.json and
results.md, overall and per test file (`data.names`, e.g. XQuAD's languages), and every answer
to `pred_file_path` as JSON lines.
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

from launcher_scripts.jobs.refusal import refuse
from launcher_scripts.recipes.tuned_evaluation import model_file_of, peft_file_of, test_files


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
    """The SftFormat keys: the recipe's data section, filled from what the PEFT file recorded.
    A text-to-text recipe bounds inputs and answers apart (max_src/tgt_seq_length)."""
    data = cfg.data
    return {
        "prompt_template": data.get("prompt_template") or stored.get("prompt_template"),
        "context_key": data.get("context_key") or "input",
        "label_key": data.get("label_key") or stored.get("label_key") or "output",
        "max_seq_length": data.get("max_seq_length")
        or data.get("max_src_seq_length")
        or stored.get("max_seq_length")  # what the PEFT run cut its inputs to
        or 2048,
        "max_tgt_seq_length": data.get("max_tgt_seq_length"),
        "truncation_field": "context",
        "add_eos": False,  # the prompt is what matters here
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "exact_match": 100 * sum(r["exact_match"] for r in rows) / len(rows),
        "f1": 100 * sum(r["f1"] for r in rows) / len(rows),
        "samples": len(rows),
    }


def results_table(results: dict[str, Any]) -> str:
    """results.md: the overall scores, then one row per test file when there are several."""
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in results.items() if k in ("exact_match", "f1")]
    per_file = results.get("per_file") or {}
    if len(per_file) > 1:
        lines += ["", "| test file | exact_match | f1 | samples |", "|---|---|---|---|"]
        lines += [
            f"| {name} | {r['exact_match']:.2f} | {r['f1']:.2f} | {r['samples']} |"
            for name, r in per_file.items()
        ]
    return "\n".join(lines) + f"\n\n{results['samples']} samples\n"


def _check_families(cfg: DictConfig) -> None:
    """The preflight's check again, for files an earlier stage of the run wrote: the model
    file is of the recipe's family, and a PEFT file was tuned on a base of that family."""
    from launcher_scripts.families import family_of
    from launcher_scripts.families.file_family import (
        evaluation_reader,
        family_problem,
        pair_problem,
    )
    from launcher_scripts.formats.portable_check import inspect_peft, inspect_portable
    from launcher_scripts.jobs.training.runtime import JobError

    base_file = model_file_of(cfg.model)
    base = inspect_portable(base_file).config
    reader = evaluation_reader("fine_tuned", cfg.get("peft_method"))
    problem = family_problem(base, family_of(cfg, "evaluation"), base_file, reader)
    tuned = peft_file_of(cfg.model)
    if problem is None and tuned is not None:
        problem = pair_problem(inspect_peft(tuned).config, tuned, base, base_file)
    if problem is not None:
        raise JobError(". ".join(problem))


def answer_part(generated: str, split_string: str | None) -> str:
    """The answer in the generated text: what follows its last `split_string` (NeMo splits the
    prompt and the generation joined, whose prompt ends with it: the same text), else all."""
    if split_string and split_string in generated:
        generated = generated.rsplit(split_string, 1)[1]
    return generated.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the evaluation stage's resolved YAML")
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig)
    from types import SimpleNamespace

    import torch

    from launcher_scripts.families import family_of
    from launcher_scripts.files import write_atomic
    from launcher_scripts.jobs.fine_tuning import peft, peft_file, sft_data
    from launcher_scripts.jobs.fine_tuning.answers import write_jsonl
    from launcher_scripts.jobs.inference.generation import generate
    from launcher_scripts.jobs.inference.runner import InferenceError, close_runner, open_model
    from launcher_scripts.jobs.models.base import runtime_of
    from launcher_scripts.jobs.training.init_weights import load_full_tensors
    from launcher_scripts.jobs.training.runtime import JobError
    from launcher_scripts.recipes.generation_params import GenerationParams

    model = cfg.model
    on_gpu = str(cfg.run.accelerator) != "cpu" and torch.cuda.is_available()
    tensor, pipeline = (
        int(model.tensor_model_parallel_size),
        int(model.pipeline_model_parallel_size),
    )
    try:
        _check_families(cfg)
        opened = open_model(model_file_of(model), tensor, pipeline, on_gpu)
        side = runtime_of(family_of(opened.config, "model")).tuning
        if side is None:
            raise JobError("this version has no tuned-model evaluation for the model's family")
    except (InferenceError, JobError, OSError, ValueError) as error:
        return refuse(error)
    try:
        chunks = opened.chunks
        tokenizer = side.text_tokenizer(opened.config)
        stored: dict[str, Any] = {}
        virtual = 0
        tuned = peft_file_of(model)
        if tuned is not None:
            loaded = peft_file.read(tuned)
            attached = peft.attach(chunks, loaded.settings, chunks[0].config, side.peft_sites)
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
        files = test_files(cfg.data)
        loaded_files, report = sft_data.load_files(
            list(files.sources),
            tokenizer,
            fmt,
            "test data",
            targets=files.targets,
            encode=side.encode,
            chat=side.chat,
        )
        if report:
            print(report, flush=True)
        inference = cfg.inference
        params = GenerationParams(
            tokens_to_generate=int(inference.tokens_to_generate),
            top_k=1 if inference.get("greedy", True) else int(inference.get("top_k") or 0),
            top_p=0.0 if inference.get("greedy", True) else float(inference.get("top_p") or 0),
            temperature=float(inference.get("temperature") or 1.0),
            repetition_penalty=float(inference.get("repetition_penalty") or 1.0),
        )
        # What the family's generation reads: the model, its input length and answer length.
        lengths = {"seq_length": fmt.max_seq_length, "seq_length_dec": params.tokens_to_generate}
        setup = OmegaConf.create({"model": {**opened.config, "data": lengths}})
        layout = SimpleNamespace(tensor=tensor, pipeline=pipeline, sequence_parallel=False)
        logits, prompts, limit = side.generation(
            setup, chunks, tokenizer, layout, on_gpu, [tokenizer.eod_id] * virtual
        )

        batch_size = int(model.get("eval_batch_size") or 1)
        rows = []
        for source, name in zip(loaded_files, files.names, strict=True):
            records = [r for r in source.records if r.prompt]
            for start in range(0, len(records), batch_size):
                batch = records[start : start + batch_size]
                outputs = generate(
                    logits, prompts, [r.prompt for r in batch], params, max_length=limit
                )
                for record, output in zip(batch, outputs, strict=True):
                    pred = answer_part(output.text, cfg.data.get("split_string"))
                    rows.append(
                        {
                            "input": record.prompt,
                            "pred": pred,
                            "answers": record.answers,
                            "file": name,
                            **scores(pred, record.answers),
                        }
                    )
        results: dict[str, Any] = summary(rows)
        results["per_file"] = {
            name: summary(own)
            for name in files.names
            if (own := [r for r in rows if r["file"] == name])
        }
        import torch.distributed as dist

        if dist.get_rank() == 0:
            results_dir = Path(str(cfg.run.results_dir))
            pred_file = Path(
                str(cfg.data.get("pred_file_path") or results_dir / "predictions.jsonl")
            )
            write_jsonl(pred_file, rows)
            write_atomic(results_dir / "results.json", json.dumps(results, indent=2) + "\n")
            write_atomic(results_dir / "results.md", results_table(results))
            print(
                f"exact_match {results['exact_match']:.2f}, f1 {results['f1']:.2f} over "
                f"{len(rows)} samples; predictions: {pred_file}",
                flush=True,
            )
        return 0
    except (sft_data.SftDataError, ValueError, OSError) as error:
        return refuse(error)
    finally:
        close_runner()


if __name__ == "__main__":
    sys.exit(main())
