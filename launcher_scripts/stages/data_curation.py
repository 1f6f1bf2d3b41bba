"""The data_curation stage: raw documents to curated JSONL shards (reference 5.17).

Its jobs, each an array over the recipe's nodes where the work splits:
  download    the source's files fetched first, when the recipe lists them (resumable);
  prepare     once, when a step needs something made first (decontamination's n-grams);
  documents   the source read and each document run through the steps (array over tasks);
  buckets     dedup candidates grouped by key partition and verified (array over partitions);
  components  duplicate clusters joined, one document kept per cluster (one process);
  write       the kept documents less the duplicates, as JSONL shards (array over tasks);
  report      what each step did, as markdown, JSON and a plot (one process).
"""

from __future__ import annotations

from pathlib import Path

from launcher_scripts.config.checks import require_int
from launcher_scripts.config.schema import Declared
from launcher_scripts.curation.recipe import CurationRecipe, read_curation
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobspec import Command, JobSpec
from launcher_scripts.stages.base import StageContext, StageDefaults, make_job, register
from launcher_scripts.stages.data_prep_common import cpu_resources, stage_key, workers_args

JOBS = "launcher_scripts.jobs.curation"
DOWNLOAD = "launcher_scripts.jobs.data_prep.download"  # resumable, sizes checked


@register
class DataCuration(StageDefaults):
    name = "data_curation"
    declared_keys = (
        Declared(optional=("run.cpus_per_node", "source.id_key", "clean.remove_lines")),
        # A rule's parameters are checked against the rule (heuristics.RULES), by name.
        Declared(free_form=("heuristics.rules",)),
    )

    @staticmethod
    def _recipe(ctx: StageContext) -> CurationRecipe:
        """The recipe as jobs() and plan() read it: its files are validate's concern."""
        return read_curation(ctx.cfg, ctx.stage, lambda path: True)

    def validate(self, ctx: StageContext) -> None:
        def exists(path: Path) -> bool:
            return path.exists() or ctx.will_exist(path)

        recipe = read_curation(ctx.cfg, ctx.stage, exists)
        require_int(stage_key(ctx, "run.node_array_size"), ctx.cfg.run.node_array_size)
        workers_args(ctx)
        files = recipe.files_if_present()  # None: counted when the job runs
        if files and recipe.tasks > len(files):
            raise ConfigError(
                stage_key(ctx, "tasks"),
                f"is {recipe.tasks} but the source has {len(files)} files (a task reads whole "
                "files, so the rest would have nothing to do)",
                f"Set {stage_key(ctx, 'tasks')}={len(files)} or less, or split the input",
            )

    def jobs(self, ctx: StageContext) -> list[JobSpec]:
        recipe = self._recipe(ctx)
        name = str(ctx.cfg.run.name)
        nodes = require_int(stage_key(ctx, "run.node_array_size"), ctx.cfg.run.node_array_size)
        config = ("--config", str(ctx.config_path))
        parallel = (*config, *workers_args(ctx))

        def job(step: str, module: str, args: tuple[str, ...], units: int, **kw: object) -> JobSpec:
            array = min(nodes, units)
            return make_job(
                ctx,
                f"{name}-{step}",
                (Command(module, args),),
                cpu_resources(ctx),
                array_size=array if array > 1 else None,
                **kw,  # type: ignore[arg-type]
            )

        jobs = []
        if (download := recipe.download) is not None:
            args = ("--url-list", download.url_list, "--list-base", download.list_base)
            args += ("--limit", str(download.limit)) if download.limit is not None else ()
            args += ("--output-dir", str(download.dir))
            units = download.limit or nodes
            jobs.append(job("download", DOWNLOAD, args, units, writes=(str(download.dir),)))
        if recipe.prepared_steps():
            jobs.append(job("prepare", f"{JOBS}.prepare", config, 1))
        # The names as given: a folder of a whole crawl is listed by the jobs, not here.
        named = tuple(str(p) for p in recipe.named_files)
        jobs.append(job("documents", f"{JOBS}.documents", parallel, recipe.tasks, reads=named))
        if recipe.deduplicates:
            jobs.append(job("buckets", f"{JOBS}.buckets", parallel, recipe.partitions))
            jobs.append(job("components", f"{JOBS}.components", config, 1))
        written = (str(recipe.output_dir),)
        jobs.append(job("write", f"{JOBS}.write", parallel, recipe.tasks, writes=written))
        results = Path(str(ctx.cfg.run.results_dir))
        report = tuple(str(results / f"curation_report.{s}") for s in ("md", "json", "png"))
        jobs.append(job("report", f"{JOBS}.report", config, 1, writes=report))
        return jobs

    def plan(self, ctx: StageContext) -> list[str]:
        recipe = self._recipe(ctx)
        steps = ", ".join(step.name for step, _ in recipe.steps) or "none"
        dedup = ["exact"] if recipe.exact_dedup else []
        if (fuzzy := recipe.fuzzy_dedup) is not None:
            dedup.append(
                f"fuzzy (Jaccard >= {fuzzy.threshold}, {fuzzy.ngram}-word shingles, "
                f"{fuzzy.banding.bands} bands x {fuzzy.banding.rows} rows)"
            )
        listed = recipe.files_if_present()
        files = (
            f"{len(listed)} {recipe.source.name} files"
            if listed is not None
            else f"{recipe.source.name} files from {', '.join(map(str, recipe.named_files))}"
        )
        return [
            f"curation: {files} in {recipe.tasks} tasks; "
            f"steps: {steps}; dedup: {', '.join(dedup) or 'none'}; output {recipe.output_dir}"
        ]
