"""Keys no program reads, booleans that are not, a cluster file of another kind, and the plan's
settings: refused in preflight with one line, before anything is written.

A misspelt key used to be silent: Hydra's hint for a key a recipe lacks is `+key=value`, which
adds it, and no program read it (`+training.model.tensor_model_paralel_size=2` trained at TP 1).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts import pipeline
from launcher_scripts.clusters import BACKENDS
from launcher_scripts.config import schema
from launcher_scripts.config.compose import compose_config, conf_dir, recipe_options
from launcher_scripts.config.preflight import resolve
from launcher_scripts.errors import ConfigError
from launcher_scripts.stages import STAGES
from tests.support import REPO
from tests.support.commands import assert_one_line_error, run_main
from tests.support.dry_runs import without_slurm
from tests.support.recipe_fills import FILLS

KINDS = ("dataset", "model_family", "evaluation_kind", "peft_method")
# Maps whose keys are the user's (checked by their stage, or passed on as they are).
FREE_FORM = ("wandb_logger_kwargs", "language_file_counts", "split_fractions")
CLUSTER_TYPES = tuple(BACKENDS)  # the cluster types are the backends' names


@functools.cache
def _recipe_content(group: str, recipe: str) -> dict:
    content = OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{recipe}.yaml"))
    assert isinstance(content, dict)
    return content


def recipe_content(group: str, recipe: str) -> dict:
    """A shipped recipe as plain data, the caller's to change (each test reads every recipe of
    its group: read once per session)."""
    return copy.deepcopy(_recipe_content(group, recipe))


@functools.cache
def one_recipe_per_kind() -> list[tuple[str, str]]:
    """(group, recipe): the first recipe of each kind (dataset, model family, evaluation kind,
    PEFT method) of every stage group."""
    chosen: dict[tuple[str, tuple], str] = {}
    for group in STAGES:
        for recipe in recipe_options(group):
            content = recipe_content(group, recipe)
            chosen.setdefault((group, tuple(str(content.get(k)) for k in KINDS)), recipe)
    return sorted((group, recipe) for (group, _), recipe in chosen.items())


def key_paths(node: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a recipe, outside free-form maps."""
    found = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        found.append(path)
        if isinstance(value, dict) and key not in FREE_FORM:
            found += key_paths(value, f"{path}.")
    return found


def typo_of(name: str) -> str:
    """The name with its middle letter left out (tensor_model_parallel_size ->
    tensor_model_paralel_size)."""
    middle = len(name) // 2
    return name[:middle] + name[middle + 1 :]


def keys_by_depth(group: str, recipe: str) -> dict[int, str]:
    """For each depth, one key of the recipe whose typo is no key of any recipe of the group."""
    names = {
        path.rsplit(".", 1)[-1]
        for other in recipe_options(group)
        for path in key_paths(recipe_content(group, other))
    }
    found: dict[int, str] = {}
    for path in sorted(key_paths(recipe_content(group, recipe))):
        depth, name = path.count(".") + 1, path.rsplit(".", 1)[-1]
        if len(name) >= 5 and typo_of(name) not in names and depth not in found:
            found[depth] = path
    return found


def set_path(node: dict, path: str, value: object) -> None:
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value


def refused(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        pipeline.plan(compose_config(overrides))
    return error.value


def typo_path(path: str) -> str:
    parent, _, name = path.rpartition(".")
    return f"{parent}.{typo_of(name)}" if parent else typo_of(name)


@pytest.mark.parametrize(("group", "recipe"), one_recipe_per_kind())
def test_a_typo_at_any_depth_is_refused_with_the_key_meant(
    group: str, recipe: str, tmp_path: Path
) -> None:
    """At every depth of every kind of stage (a typo added to the composed config, as `+` does),
    on the command line with + (Hydra's hint) and in a user's recipe file; the one line names
    the typo and the key meant."""
    depths = sorted(keys_by_depth(group, recipe).items())
    assert len(depths) >= 2, depths
    common = [f"stages=[{group}]", *FILLS.get((group, recipe), []), "dry_run=true"]
    common += [f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data"]
    base = compose_config([f"{group}={recipe}", *common])
    for _, path in depths:
        typo = typo_path(path)
        broken = base.copy()
        OmegaConf.update(broken, f"{group}.{typo}", 2, force_add=True)
        with pytest.raises(ConfigError) as error:
            pipeline.plan(broken)
        assert error.value.key == f"{group}.{typo}", str(error.value)
        assert f"Did you mean {group}.{path}?" in str(error.value), str(error.value)

    deepest, shallowest = depths[-1][1], depths[0][1]
    error = refused([f"{group}={recipe}", f"+{group}.{typo_path(deepest)}=2", *common])
    assert error.key == f"{group}.{typo_path(deepest)}"
    assert f"Did you mean {group}.{deepest}?" in str(error), str(error)

    content = recipe_content(group, recipe)
    set_path(content, typo_path(shallowest), 2)
    user_recipe = tmp_path / f"my_{group}.yaml"
    OmegaConf.save(OmegaConf.create(content), user_recipe)
    error = refused([f"{group}={user_recipe}", *common])
    assert error.key == f"{group}.{typo_path(shallowest)}"
    assert f"Did you mean {group}.{shallowest}?" in str(error), str(error)


def test_the_issues_typo_from_the_command_line_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    for override in (
        "+training.model.tensor_model_paralel_size=2",
        "training.model.tensor_model_paralel_size=2",  # without +: not Hydra's "use +" hint
    ):
        result = run_main(
            "stages=[training]", f"base_results_dir={results}", "dry_run=true", override
        )
        assert_one_line_error(
            result,
            "training.model.tensor_model_paralel_size",
            "Did you mean training.model.tensor_model_parallel_size?",
        )
        assert not results.exists()


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        ("+foo=1", "foo", "conf/config.yaml"),
        ("plan.tflops=3", "plan.tflops", "Did you mean plan.tflops_per_gpu?"),
        ("+numa_mapping.min_core=2", "numa_mapping.min_core", "numa_mapping.min_cores"),
        ("cluster.gpu_memory=24", "cluster.gpu_memory", "cluster.gpu_memory_gb"),
        ("+cluster.partition=gpu", "cluster.partition", "cluster_type=bcm"),
    ],
)
def test_root_and_cluster_keys_are_checked(override: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        pipeline.plan(pipeline.compose(["stages=[training]", "dry_run=true", override]))
    assert error.value.key == key and fragment in str(error.value), str(error.value)


@pytest.mark.parametrize(
    ("stage", "override", "meant"),
    [
        ("data_preparation", "data_preparation.run.nodes=2", "run.node_array_size"),
        ("data_preparation", "+data_preparation.run.nodes=2", "run.node_array_size"),
        ("data_preparation", "+data_preparation.run.ntasks_per_node=4", "run.workers_per_node"),
        ("data_preparation", "+data_preparation.run.time=4:00:00", "run.time_limit"),
        ("training", "+training.run.nodes=2", "trainer.num_nodes"),
        ("training", "+training.trainer.gpus=8", "trainer.devices"),
        ("training", "+training.run.accelerator=cpu", "trainer.accelerator"),
        ("fine_tuning", "+fine_tuning.run.num_nodes=2", "trainer.num_nodes"),
        ("evaluation", "evaluation.trainer.accelerator=cpu", "run.accelerator"),
    ],
)
def test_a_key_of_a_setting_this_recipe_names_otherwise_names_its_key(
    stage: str, override: str, meant: str
) -> None:
    """A key no program reads, that names a setting the recipe has under another name (another
    stage's, NeMo's or Lightning's): use this recipe's key instead."""
    with pytest.raises(ConfigError) as error:
        pipeline.plan(pipeline.compose([f"stages=[{stage}]", "dry_run=true", override]))
    key = override.lstrip("+").partition("=")[0]
    assert error.value.key == key, str(error.value)
    assert "no program reads it" in str(error.value)
    assert f"Use {stage}.{meant} instead" in str(error.value), str(error.value)


def test_a_key_the_stage_reads_but_the_recipe_leaves_out_is_added_with_plus() -> None:
    """num_query_groups is a GPT training key gpt3/tiny does not set: the line says to add it
    (and with + it is accepted), rather than calling it unknown."""
    with pytest.raises(ConfigError, match=r"Add it with \+training.model.num_query_groups=2"):
        pipeline.compose(["training.model.num_query_groups=2"])
    pipeline.plan(
        compose_config(["stages=[training]", "dry_run=true", "+training.model.num_query_groups=2"])
    )


def test_a_key_of_another_family_names_the_recipes_that_have_it() -> None:
    error = refused(["stages=[training]", "dry_run=true", "+training.model.encoder.num_layers=2"])
    assert error.key == "training.model.encoder" and "training=mt5/" in str(error), str(error)
    error = refused(
        ["stages=[training]", "dry_run=true", "+training.model.optim.sched.warmup_ratio=0.1"]
    )
    assert "t5/" in str(error), str(error)  # GPT's schedule reads warmup_steps, not a ratio


def test_free_form_maps_take_any_key() -> None:
    pipeline.plan(
        compose_config(
            [
                "stages=[training]",
                "dry_run=true",
                "+env_vars.MY_VARIABLE=1",
                "+training.exp_manager.wandb_logger_kwargs.entity=team",
                "cluster_type=bcm",
                "+cluster.sbatch_options.constraint=h100",
            ]
        )
    )


@pytest.mark.parametrize("group", sorted(STAGES))
def test_every_declared_optional_key_is_accepted(group: str) -> None:
    """The keys the programs read with a default (declared beside that code) pass the check
    when added with +, in every recipe kind they are declared for."""
    for recipe_group, recipe in one_recipe_per_kind():
        if recipe_group != group:
            continue
        cfg = compose_config([f"{group}={recipe}"])
        content = OmegaConf.to_container(cfg[group], resolve=False)
        assert isinstance(content, dict)
        kind = schema.kind_of(content)
        for declared in pipeline.declared_keys()[group]:
            if not declared.applies_to(kind):
                continue
            for path in declared.optional:
                parent = path.rpartition(".")[0]
                node = content
                for part in parent.split(".") if parent else ():
                    node = node.setdefault(part, {}) if isinstance(node, dict) else {}
                if isinstance(node, dict):
                    node.setdefault(path.rsplit(".", 1)[-1], 1)
        cfg[group] = OmegaConf.create(content)
        schema.check_known_keys(cfg, [group], pipeline.declared_keys())


# Test files that add refused keys on purpose.
REFUSING = {Path(__file__).name, "test_nemo_keys.py", "test_optimizer_preflight.py"}
PLUS_OVERRIDE = re.compile(r"""["']\+\+?([a-z_]+(?:\.[A-Za-z_0-9]+)+)=""")


def test_the_plus_overrides_the_suite_and_the_autoconfigurator_use_are_known() -> None:
    """Every `+key=` / `++key=` override written in the tests and the AutoConfigurator's search
    configs is one the key check accepts (a stage's, the root's or a free-form map's)."""
    sources = [
        *sorted((REPO / "tests").glob("*.py")),
        *(REPO / "auto_configurator").rglob("*.yaml"),
    ]
    found = {
        key
        for path in sources
        if path.name not in REFUSING
        for key in PLUS_OVERRIDE.findall(path.read_text())
    }
    assert found, "no + overrides found: the pattern is wrong"
    for key in sorted(found):
        group = key.split(".")[0]
        stages = [group] if group in STAGES else ["training"]
        if group == "cluster":  # a cluster key is known when one cluster type's file has it
            refusals = []
            for cluster_type in CLUSTER_TYPES:
                cfg = compose_config([f"cluster_type={cluster_type}", f"++{key}=1"])
                try:
                    schema.check_known_keys(cfg, stages, pipeline.declared_keys())
                    break
                except ConfigError as error:
                    refusals.append(str(error))
            else:
                pytest.fail(f"no cluster type knows {key}: {refusals}")
            continue
        extra = []
        if group == "data_preparation" and "split_fractions" in key:
            extra.append("data_preparation=sft/dolly")
        cfg = compose_config([*extra, f"+{key}=1"])
        schema.check_known_keys(cfg, stages, pipeline.declared_keys())


# ----- booleans -----------------------------------------------------------------------------


MISSING = object()


@pytest.mark.parametrize(
    "group", [g for g in ["", "cluster", *sorted(STAGES)] if schema.boolean_keys(g)]
)
def test_every_boolean_key_must_be_a_boolean(group: str) -> None:
    """Each key that is true/false in the shipped files refuses a word (Hydra passes an unknown
    word on as a string, and strings are true)."""
    recipes = [r for g, r in one_recipe_per_kind() if g == group] if group in STAGES else [None]
    stages = [group] if group in STAGES else []
    checked = 0
    for recipe in recipes:
        overrides = [f"{group}={recipe}", *FILLS.get((group, recipe), [])] if recipe else []
        overrides += ["cluster_type=bcm"] if group == "cluster" else []
        resolved = resolve(compose_config(overrides), stages)
        for path in schema.boolean_keys(group):
            key = f"{group}.{path}" if group else path
            if OmegaConf.select(resolved, key, default=MISSING) is MISSING:
                continue
            broken = resolved.copy()
            OmegaConf.update(broken, key, "maybe", merge=False)
            with pytest.raises(ConfigError) as error:
                schema.check_booleans(broken, stages)
            assert error.value.key == key and "'maybe' is not true" in str(error.value)
            checked += 1
    assert checked, f"no boolean key of {group or 'the root'} was checked"


def test_dry_run_maybe_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    results = tmp_path / "results"
    result = run_main("stages=[data_preparation]", f"base_results_dir={results}", "dry_run=maybe")
    assert_one_line_error(result, "dry_run", "'maybe' is not true or false")
    assert not results.exists()


# ----- the cluster file ---------------------------------------------------------------------


@pytest.mark.parametrize("cluster_type", CLUSTER_TYPES)
@pytest.mark.parametrize("cluster", CLUSTER_TYPES)
def test_a_shipped_cluster_file_must_match_the_cluster_type(
    cluster: str, cluster_type: str
) -> None:
    overrides = [f"cluster_type={cluster_type}", f"cluster={cluster}"]
    # NeMo's `cluster: bcm` is kept with cluster_type=bcp, and means the bcp file.
    if cluster == cluster_type or (cluster, cluster_type) == ("bcm", "bcp"):
        assert compose_config(overrides).cluster == OmegaConf.load(
            conf_dir() / "cluster" / f"{cluster_type}.yaml"
        )
        return
    with pytest.raises(ConfigError) as error:
        compose_config(overrides)
    assert error.value.key == "cluster"
    assert f"cluster={cluster}" in str(error.value) and f"cluster_type={cluster_type}" in str(
        error.value
    )


def test_local_with_the_slurm_file_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    results = tmp_path / "results"
    result = run_main(
        "stages=[data_preparation]",
        f"base_results_dir={results}",
        "cluster_type=local",
        "cluster=bcm",
    )
    assert_one_line_error(result, "cluster", "cluster_type=local", "cluster_type=bcm")
    assert not results.exists()


@pytest.mark.parametrize("cluster_type", CLUSTER_TYPES)
def test_a_sites_own_cluster_file_of_the_same_kind_works(cluster_type: str, tmp_path: Path) -> None:
    site = OmegaConf.load(conf_dir() / "cluster" / f"{cluster_type}.yaml")
    site.gpu_memory_gb = 40
    path = tmp_path / "site.yaml"
    OmegaConf.save(site, path)
    cfg = compose_config([f"cluster_type={cluster_type}", f"cluster={path}", "stages=[export]"])
    assert cfg.cluster.gpu_memory_gb == 40
    schema.check_known_keys(cfg, ["export"], pipeline.declared_keys())


def test_a_sites_cluster_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    site = OmegaConf.load(conf_dir() / "cluster" / "bcm.yaml")
    path = tmp_path / "site.yaml"
    OmegaConf.save(site, path)
    with pytest.raises(ConfigError) as error:
        pipeline.plan(compose_config(["cluster_type=local", f"cluster={path}", "dry_run=true"]))
    assert error.value.key.startswith("cluster.")
    assert "cluster_type=bcm" in str(error.value) and "local" in str(error.value)


# ----- the plan's settings -------------------------------------------------------------------


def plan_lines(*overrides: str) -> list[str]:
    backend, resolved, planned = pipeline.plan(
        compose_config(
            [
                "stages=[training]",
                "training=gpt3/126m",
                "cluster_type=bcm",
                "dry_run=true",
                *overrides,
            ]
        )
    )
    from launcher_scripts.costmodel import plan
    from launcher_scripts.families import family_of

    family = family_of(resolved.training, "training")
    return plan.describe(family.plan(resolved, "training"))


def test_plan_settings_reach_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    without_slurm(monkeypatch)  # gpt3/126m's 8 nodes, for a cluster, not this machine's Slurm
    default = next(line for line in plan_lines() if "time to train" in line)
    assert "at 140 model TFLOP/s" in default
    faster = next(line for line in plan_lines("plan.tflops_per_gpu=280") if "time to train" in line)
    assert "at 280 model TFLOP/s" in faster
    days = [float(re.search(r"= ([\d.]+) days", line).group(1)) for line in (default, faster)]
    assert days[1] == pytest.approx(days[0] / 2, rel=0.05)
    tokens = next(line for line in plan_lines("plan.num_tokens=1e9") if "time to train" in line)
    assert "1 B tokens" in tokens


@pytest.mark.parametrize("value", ["fast", "-5", "0", "true"])
def test_plan_settings_are_positive_numbers(value: str) -> None:
    with pytest.raises(ConfigError, match="plan.tflops_per_gpu"):
        plan_lines(f"plan.tflops_per_gpu={value}")
