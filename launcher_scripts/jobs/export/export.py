"""The export job: a portable checkpoint to a Triton model repository, checked by loading it.

    python -m launcher_scripts.jobs.export.export --config <results_dir>/<name>_hydra.yaml

The job writes the new repository beside the old one, loads its served model file the way the
Triton model will and generates from `export.check.prompt` with the export's default
parameters, then measures lambada accuracy on `export.check.lambada_file` (NeMo's check of an
export); only then does the new repository replace the old one. A repository that cannot
serve fails here, not when a server starts, and a failed export leaves the last good one in
place. The check's results are kept in check.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

import launcher_scripts
from launcher_scripts.files import replaced_directory, write_atomic
from launcher_scripts.jobs.config_job import run_config_job
from launcher_scripts.recipes.triton_interface import generation_defaults


def export(cfg: DictConfig) -> None:
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.families import family_of
    from launcher_scripts.families.file_family import EXPORT_READER, family_problem
    from launcher_scripts.formats.portable_check import inspect_portable
    from launcher_scripts.jobs.export.repository import MODEL_FILE, VERSION, write_repository
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served

    model_file = Path(str(cfg.model.nemo_file))
    # The preflight's check again, for a file an earlier stage of the run wrote.
    problem = family_problem(
        inspect_portable(model_file).config, family_of(cfg, "export"), model_file, EXPORT_READER
    )
    if problem is not None:
        raise ConfigError("export.model.nemo_file", *problem)
    deployment = cfg.triton_deployment
    defaults = generation_defaults(cfg)
    GenerationParams(**defaults).check()
    repository = Path(str(deployment.model_repository))
    prompt = str(cfg.check.prompt)
    with replaced_directory(repository) as partial:
        models = write_repository(
            partial,
            str(deployment.model_name),
            model_file,
            max_batch_size=int(deployment.max_batch_size),
            max_queue_delay_microseconds=int(deployment.max_queue_delay_microseconds),
            defaults=defaults,
            max_request_tokens=int(deployment.max_request_tokens),
            tensor=int(cfg.model.get("tensor_model_parallel_size") or 1),
            pipeline=int(deployment.get("pipeline_model_parallel_size") or 1),
            # The server imports the code that wrote the repository.
            launcher_path=str(Path(launcher_scripts.__file__).resolve().parent.parent),
        )
        served = open_served(models[0] / VERSION / MODEL_FILE)
        try:
            completion = generate(
                served.decoding,
                served.tokenizer,
                [prompt],
                GenerationParams(**defaults),
                max_length=served.max_length,
            )[0]
            scored = lambada_check(served, cfg.check)
        finally:
            close_runner()
    for model in models:
        print(f"wrote {repository / model.name}", flush=True)
    vllm = cfg.get("vllm")
    if vllm is not None and bool(vllm.enabled):
        from launcher_scripts.jobs.export.vllm_repository import engine_args, write_vllm_repository

        tensor = int(cfg.model.get("tensor_model_parallel_size") or 1)
        pipeline = int(deployment.get("pipeline_model_parallel_size") or 1)
        args = engine_args(Path(str(vllm.hf_dir)), tensor, pipeline, dict(vllm))
        with replaced_directory(Path(str(vllm.model_repository))) as partial:
            written = write_vllm_repository(partial, str(deployment.model_name), args)
        print(f"wrote {Path(str(vllm.model_repository)) / written.name} (vLLM)", flush=True)
    print(f"check: {prompt!r} -> {completion.text!r} ({completion.finish_reason})", flush=True)
    check = {"prompt": prompt, "text": completion.text, "finish_reason": completion.finish_reason}
    if scored is not None:
        check["lambada"] = scored
        print(
            f"lambada: acc {scored['acc']:.4f} over {scored['examples']} passages of "
            f"{scored['file']} (lm-eval's lambada acc: compare with the evaluation stage's)",
            flush=True,
        )
    write_atomic(Path(str(cfg.run.results_dir)) / "check.json", json.dumps(check, indent=2))


def lambada_check(served: Any, check: DictConfig) -> dict[str, Any] | None:
    """The exported model's lambada accuracy (recipes/lambada.py), or None when the check has
    no lambada_file. Passages are decoded greedily, those of one target length together."""
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.recipes import lambada

    if check.get("lambada_file") is None:
        return None
    path = Path(str(check.lambada_file))
    limit = check.get("lambada_limit")
    examples = lambada.read_examples(path, None if limit is None else int(limit))
    tokenizer = served.tokenizer
    by_length: dict[int, list[tuple[str, list[int]]]] = {}
    for example in examples:
        context = tokenizer.encode(example.context)
        whole = tokenizer.encode(example.context + example.target)
        target = whole[len(context) :] if whole[: len(context)] == context else None
        target = target or tokenizer.encode(example.target)
        by_length.setdefault(len(target), []).append((example.context, target))
    right = []
    for length, group in sorted(by_length.items()):
        params = GenerationParams(tokens_to_generate=length, top_k=1)
        done = generate(
            served.decoding,
            tokenizer,
            [context for context, _ in group],
            params,
            max_length=served.max_length,
        )
        right += [list(c.tokens) == target for c, (_, target) in zip(done, group, strict=True)]
    return {"file": str(path), "examples": len(right), "acc": lambada.accuracy(right)}


def _input_errors() -> tuple[type[BaseException], ...]:
    from launcher_scripts.errors import ConfigError
    from launcher_scripts.formats.tokenizer import TokenizerError
    from launcher_scripts.jobs.inference.runner import InferenceError

    return (ConfigError, InferenceError, TokenizerError, ValueError)


def main(argv: list[str] | None = None) -> int:
    return run_config_job(argv, __doc__.splitlines()[0], "export", export, _input_errors)


if __name__ == "__main__":
    sys.exit(main())
