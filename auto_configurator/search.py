"""The training HP search: rank the feasible layouts by predicted step time, measure the most
promising `limit_search_runs` of them with short real runs, and report the measured fastest."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from auto_configurator import report, runner
from auto_configurator.base_config import BaseConfig, size_label
from auto_configurator.candidates import Evaluated, require_feasible
from auto_configurator.recipes import STAGE, compose_recipe, write_recipe
from auto_configurator.settings import TrainSettings
from launcher_scripts import pipeline
from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config.checks import require_choice
from launcher_scripts.config.compose import compose_config
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.families import of_model_type
from launcher_scripts.files import write_atomic


@dataclass(frozen=True)
class SearchResult:
    folder: Path  # <logs>/final_results
    outcomes: tuple[report.Outcome, ...]
    best: report.Outcome | None
    best_config: Path | None
    summary: dict


def check_searchable(settings: TrainSettings) -> None:
    """Only models this launcher trains are measured."""
    family = of_model_type(settings.family)
    if not family.runs("training"):
        raise ConfigError(
            "run_training_hp_search",
            f"cannot search {settings.family} layouts: this launcher version has no "
            f"{family.name} training job to measure with",
            "Set run_training_hp_search=false; the base config is written either way",
        )


SEARCH_BACKENDS = ("local", "bcm", "bcp")  # where the measured runs can go in this version


def run(cfg: DictConfig, settings: TrainSettings, base: BaseConfig) -> SearchResult:
    require_choice("cluster_type", cfg.cluster_type, SEARCH_BACKENDS)
    check_searchable(settings)
    assert base.space is not None and base.model is not None
    ranking = require_feasible(base.evaluated, base.model, base.space, settings)
    chosen = ranking[: settings.limit_search_runs]
    evaluated = base.evaluated
    invalid = sum(not e.valid for e in evaluated)
    too_big = sum(e.valid and not e.fits for e in evaluated)
    print(
        f"search: {len(evaluated)} candidate layouts: {invalid} break a divisibility rule, "
        f"{too_big} exceed {settings.memory_limit_bytes / 2**30:.1f} GiB per GPU, "
        f"{len(ranking)} feasible; measuring the {len(chosen)} predicted fastest "
        f"(limit_search_runs) on {cfg.cluster_type}"
    )
    runs = runner.plan_runs(cfg, settings, base.path, base.recipe, [e.candidate for e in chosen])
    evaluated_of = {run.index: e for run, e in zip(runs, chosen, strict=True)}
    refused = preflight(runs, settings.logs / runner.CANDIDATE_CONFIGS)
    outcomes = {**refused, **_measure(cfg, settings, [r for r in runs if r.index not in refused])}
    results = tuple(
        report.Outcome(run, evaluated_of[run.index], outcomes[run.index]) for run in runs
    )
    return _report(settings, base, ranking, results)


def preflight(runs: list[runner.Run], configs: Path) -> dict[int, runner.Measurement]:
    """The launcher's own checks of every run (composition, validation, rendering), before any
    is started; each run's resolved training recipe is written to `configs`. A run it refuses
    is recorded and not started; when it refuses them all the reason is the base config's or
    the setup's, and is raised."""
    refused: dict[int, runner.Measurement] = {}
    first: LauncherError | None = None
    for run in runs:
        try:
            _, resolved, _ = pipeline.plan(compose_config(list(run.argv[2:])))
            configs.mkdir(parents=True, exist_ok=True)
            text = OmegaConf.to_yaml(resolved.training)
            write_atomic(configs / f"candidate_{run.index}.yaml", text)
        except LauncherError as error:
            first = first or error
            message = str(error).splitlines()[0]
            refused[run.index] = runner.Measurement("REFUSED", 2, failure=f"refused: {message}")
    if first is not None and len(refused) == len(runs):
        raise first
    return refused


def _measure(
    cfg: DictConfig, settings: TrainSettings, runs: list[runner.Run]
) -> dict[int, runner.Measurement]:
    with tqdm(total=len(runs), desc="measured runs", unit="run") as bar:

        def progress(run: runner.Run, measurement: runner.Measurement) -> None:
            result = (
                f"{measurement.step_time_s:.4g} s/step"
                if measurement.measured
                else measurement.failure
            )
            bar.write(f"  candidate_{run.index} ({run.candidate.label}): {result}")
            bar.update(1)

        # local and bcp run each job to its end (on BCP, on the BCP job's nodes).
        if BACKENDS[cfg.cluster_type].synchronous:
            return runner.run_local(runs, cfg, settings, progress)
        return runner.run_cluster(runs, cfg, progress, float(cfg.search_poll_seconds))


def _report(
    settings: TrainSettings,
    base: BaseConfig,
    ranking: list[Evaluated],
    outcomes: tuple[report.Outcome, ...],
) -> SearchResult:
    folder = settings.logs / "final_results"
    report.write_tables(folder, base.evaluated, ranking, outcomes, settings.output_top_n)
    fastest = report.measured_fastest(outcomes)
    best = fastest[0] if fastest else None
    best_config = write_best_config(settings, base, best, folder) if best else None
    title = f"{settings.family} {size_label(base.size_in_b)}, {settings.gpus} GPUs"
    plotted = report.plot(outcomes, folder / "predicted_vs_measured.png", title)
    summary = report.write_summary(
        folder, outcomes, best_config, len(base.evaluated), base.recipe.model
    )
    if fastest:
        print(f"\nthe {min(settings.output_top_n, len(fastest))} fastest measured layouts:")
        print(report.top_table(outcomes, settings.output_top_n))
    rho = summary["spearman_predicted_vs_measured"]
    if rho is not None:
        print(f"rank correlation of predicted and measured step times (Spearman): {rho:.2f}")
    failed = summary["failed"]
    print(
        f"results: {folder}/candidates.csv" + (f", {failed} failed: failed_jobs.csv" * bool(failed))
    )
    if plotted:
        print(f"plot: {folder / 'predicted_vs_measured.png'}")
    if best_config:
        print(f"best: candidate_{best.run.index} ({best.evaluated.candidate.label}); its recipe:")
        print(f"  python3 main.py stages=[training] training={best_config}")
    else:
        print("no run measured a step time: see failed_jobs.csv")
    return SearchResult(folder, outcomes, best, best_config, summary)


def write_best_config(
    settings: TrainSettings, base: BaseConfig, best: report.Outcome, folder: Path
) -> Path:
    """The base config with the fastest measured layout: a recipe the launcher runs as is."""
    overrides = best.evaluated.candidate.overrides(STAGE, base.recipe.model)
    root = compose_recipe(str(base.path), overrides, "search_config")
    path = folder / f"optimal_config_{size_label(base.size_in_b)}_{settings.num_nodes}nodes.yaml"
    m = best.measurement
    header = (
        f"The fastest layout the AutoConfigurator measured for {base.path.name}: "
        f"{best.evaluated.candidate.label},\n"
        f"{m.step_time_s:.4g} s per step (median of {m.steps} steps after the warm-up).\n"
        f"Run it: python3 main.py stages=[training] training={path}"
    )
    write_recipe(path, root[STAGE], header)
    return path
