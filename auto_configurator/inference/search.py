"""The inference HP search (`run_inference_hp_search=true`): every TP x PP x batch size of
`search_config.inference_settings`, measured on this machine for a portable model file.

For each combination it measures the latency of one request (the wall time for `batch` prompts
of `input_len` tokens to get `output_len` new tokens each), the generated tokens/s, and tokens/s
per GPU (TP x PP of them). Two paths, named in the CSV's `path` column:

  triton  TP = PP = 1 through the export stage and a real Triton server (`serve`), one HTTP
          request per measurement: what a user deploys. The served model builds its runner at
          TP = PP = 1 only, so this path has no larger layouts (see triton.py).
  runner  every layout with the generation runner in TP x PP processes under torchrun (one
          process for TP = PP = 1): `open_runner` + `generate`, the same model code Triton's
          model.py calls, without HTTP and Triton's queue (see bench.py).

With a Triton server installed (`python3 -m launcher_scripts install-triton`;
run.serve_with_triton: auto) TP = PP = 1 is measured both ways, so layouts compare on one path
and the serving overhead shows. Layouts with more processes than run.gpus_per_node are listed as
skipped; a layout that does not divide the heads or layers, a missing model file, or lengths
beyond the model's positions stop the search before anything runs, in one line.

Results go to `<run.results_dir>/inference/`: final_summary/ (see report.py) and runs/
(each measurement's log and raw figures).
"""

from __future__ import annotations

import itertools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from auto_configurator.inference import report, triton
from auto_configurator.inference.prompts import load_tokenizer, make_prompts
from auto_configurator.inference.runs import RUNNER, Point, environment, measure_runner
from auto_configurator.inference.settings import (
    PREFIX,
    InferenceSettings,
    ModelFacts,
    parse,
    read_model,
)
from auto_configurator.runner import launcher_main
from launcher_scripts.errors import ConfigError
from launcher_scripts.files import write_atomic
from launcher_scripts.formats.tokenizer import TokenizerError
from launcher_scripts.jobs.inference.text_tokenizer import TextTokenizer


@dataclass(frozen=True)
class Plan:
    settings: InferenceSettings
    model: ModelFacts
    on_gpu: bool
    triton: bool  # TP = PP = 1 through a Triton server as well
    tokenizer: TextTokenizer
    prompts: list[str]  # one per row of the largest batch, each input_len tokens


def prepare(cfg: DictConfig) -> Plan:
    """Every check that needs no measurement, so bad inputs stop the search (and any training
    search before it) at once."""
    if cfg.cluster_type != "local":
        raise ConfigError(
            "cluster_type",
            f"{cfg.cluster_type!r}: the inference search measures on the machine it runs on",
            "Start it on a GPU node with cluster_type=local",
        )
    settings = parse(_section(cfg))
    model = read_model(settings)
    import torch

    on_gpu = torch.cuda.is_available()
    devices = torch.cuda.device_count() if on_gpu else 0
    if on_gpu and settings.gpus_per_node > devices:
        raise ConfigError(
            f"{PREFIX}.run.gpus_per_node",
            f"{settings.gpus_per_node} but this machine has {devices} GPU(s)",
            f"Set gpus_per_node={devices} or run the search where the GPUs are",
        )
    through_triton = (1, 1) in layouts(settings) and triton.available(settings)
    if through_triton:
        launcher_main(cfg)  # the export stage runs from it
    with tempfile.TemporaryDirectory(prefix="autoconfig-tokenizer-") as scratch:
        # Loaded whole into memory: the extracted files are not needed afterwards.
        try:
            tokenizer = load_tokenizer(settings.model_file, Path(scratch))
        except TokenizerError as error:
            raise ConfigError(
                f"{PREFIX}.run.model_file",
                f"its tokenizer cannot be loaded: {error}",
                "Convert the model again with the launcher's conversion stage",
            ) from None
    prompts = make_prompts(tokenizer, settings.input_len, max(settings.batch_sizes))
    return Plan(settings, model, on_gpu, through_triton, tokenizer, prompts)


def _section(cfg: DictConfig) -> dict | None:
    section = cfg.search_config.get("inference_settings")
    if section is None:
        return None
    try:
        resolved = OmegaConf.to_container(section, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        key = f"{PREFIX}.{error.full_key or ''}".rstrip(".")
        raise ConfigError(key, "has no value (???)", f"Set it: {key}=...") from None
    assert isinstance(resolved, dict)
    return resolved


def layouts(settings: InferenceSettings) -> list[tuple[int, int]]:
    return list(itertools.product(settings.tensor_parallel_sizes, settings.pipeline_parallel_sizes))


def run(cfg: DictConfig, plan: Plan) -> int:
    """Measure every combination and write the results; 0 when at least one was measured."""
    settings = plan.settings
    root = Path(str(cfg.launcher_scripts_path))
    env = environment(root, plan.on_gpu)
    folder = settings.folder
    data_type = plan.model.data_type
    prompts_file = folder / "prompts.json"
    write_atomic(prompts_file, json.dumps(plan.prompts, indent=1))
    print(_describe(plan, data_type), flush=True)
    points: list[Point] = []
    if plan.triton:
        session = triton.Session(
            settings, plan.prompts, plan.tokenizer, launcher_main(cfg), root, env
        )
        points += _announce(triton.measure(session))
    for tensor, pipeline in layouts(settings):
        if tensor * pipeline > settings.gpus_per_node:
            status = (
                f"skipped: TP x PP = {tensor * pipeline} processes exceed "
                f"run.gpus_per_node {settings.gpus_per_node}"
            )
            points += [
                Point(RUNNER, tensor, pipeline, b, status=status) for b in settings.batch_sizes
            ]
            continue
        points += _announce(measure_runner(settings, tensor, pipeline, prompts_file, root, env))
    result = report.write(folder / "final_summary", points, settings, data_type)
    _print_summary(folder / "final_summary", result)
    return 0 if result["measured"] else 1


def _describe(plan: Plan, data_type: str) -> str:
    s = plan.settings
    where = "GPUs" if plan.on_gpu else "the CPU (one thread per process)"
    paths = "through Triton and the runner" if plan.triton else "through the runner only"
    return (
        f"inference search: {s.model_file} ({data_type}), TP {list(s.tensor_parallel_sizes)} "
        f"x PP {list(s.pipeline_parallel_sizes)} x batch {list(s.batch_sizes)}, {s.input_len} "
        f"tokens in, {s.output_len} out, on {where}; TP=PP=1 {paths}"
    )


def _announce(points: list[Point]) -> list[Point]:
    for p in points:
        if p.measured:
            figures = (
                f"{(p.latency_s or 0) * 1000:.1f} ms, {p.tokens_per_s:.1f} tokens/s, "
                f"{p.tokens_per_s_per_gpu:.1f} per GPU"
            )
        else:
            figures = p.status
        print(f"  {report.label(p)}: {figures}", flush=True)
    return points


def _print_summary(folder: Path, result: dict) -> None:
    print(
        f"inference search: {result['measured']} of {result['combinations']} combinations "
        f"measured; results in {folder}"
    )
    best = result["best_tokens_per_s_per_gpu"]
    if best:
        print(
            f"  highest tokens/s per GPU: {best['path']} TP={best['tp']} PP={best['pp']} batch "
            f"{best['batch']}: {best['tokens_per_s_per_gpu']:.1f} ({best['latency_ms']:.1f} ms)"
        )
    for entry in result["best_per_latency_budget"]:
        chosen = entry["best"]
        within = f"within {entry['max_latency_ms']:g} ms"
        if chosen is None:
            print(f"  {within}: no measured combination")
        else:
            print(
                f"  {within}: {chosen['path']} TP={chosen['tp']} PP={chosen['pp']} batch "
                f"{chosen['batch']}: {chosen['tokens_per_s_per_gpu']:.1f} tokens/s per GPU "
                f"({chosen['latency_ms']:.1f} ms)"
            )
