"""What the launcher says once and every reader takes from there: the backend and stage
interfaces in full, the cluster types (the backends' names), the precisions, the rule that
tensor parallelism splits the attention heads, and the tuning stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from launcher_scripts import families, pipeline
from launcher_scripts.clusters import BACKENDS, Backend
from launcher_scripts.clusters.local import LocalBackend
from launcher_scripts.config.checks import require_heads_split, require_layout
from launcher_scripts.config.compose import compose_config, config_groups
from launcher_scripts.errors import ConfigError
from launcher_scripts.families.gpt_hf_config import PRECISIONS as HF_DTYPE_PRECISIONS
from launcher_scripts.recipes import evaluation, training
from launcher_scripts.recipes.layout import Layout, check_layout, read_layout
from launcher_scripts.recipes.model_shape import ModelShape
from launcher_scripts.recipes.precision import PRECISIONS
from launcher_scripts.recipes.tuning import OPTIONAL_KEYS, TUNING_STAGES
from launcher_scripts.stages import STAGES, Stage
from launcher_scripts.stages.fine_tuning import TuningStage

REPO = Path(__file__).resolve().parents[1]


# ----- the interfaces ---------------------------------------------------------------------


def protocol_members(protocol: type) -> set[str]:
    """The attributes and methods a Protocol declares."""
    declared = {name for name in vars(protocol) if not name.startswith("_")}
    return declared | set(vars(protocol).get("__annotations__", {}))


def test_the_protocols_declare_the_hooks_the_pipeline_asks_for() -> None:
    assert {"script_suffix", "plan_notes", "outer_launch"} <= protocol_members(Backend)
    assert {"declared_keys", "plan"} <= protocol_members(Stage)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_answers_all_of_its_interface(name: str) -> None:
    backend = BACKENDS[name]
    missing = sorted(m for m in protocol_members(Backend) if not hasattr(backend, m))
    assert missing == [], f"{backend.__name__} lacks {missing}"


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_answers_all_of_its_interface(name: str) -> None:
    missing = sorted(m for m in protocol_members(Stage) if not hasattr(STAGES[name], m))
    assert missing == [], f"stage {name} lacks {missing}"


# ----- the cluster types --------------------------------------------------------------------


def dry_run(tmp_path: Path, *overrides: str) -> list[str]:
    cfg = compose_config(
        [
            "stages=[data_preparation]",
            "data_preparation=generic/custom_dataset",
            f"data_dir={tmp_path / 'data'}",
            f"base_results_dir={tmp_path / 'results'}",
            "dry_run=true",
            *overrides,
        ]
    )
    backend, _resolved, planned = pipeline.plan(cfg)
    return [str(job.script_path) for stage in planned for job in stage.jobs]


def test_a_backend_is_a_cluster_type_preflight_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(BACKENDS, "workstation", LocalBackend)
    assert dry_run(tmp_path, "cluster_type=workstation")


def test_a_cluster_type_without_a_backend_is_refused_naming_the_backends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(BACKENDS, "bcp")
    with pytest.raises(ConfigError) as error:
        dry_run(tmp_path, "cluster_type=bcp")
    others = ", ".join(BACKENDS)  # the backends left, in their registry's order
    assert str(error.value) == f"cluster_type: 'bcp' is not valid. Use one of: {others}"


def test_every_backend_has_its_cluster_file() -> None:
    """`cluster_type=<name>` picks conf/cluster/<name>.yaml (config.compose.matching_cluster)."""
    shipped = {path.stem for path in (REPO / "conf" / "cluster").glob("*.yaml")}
    assert shipped == set(BACKENDS)


# ----- the precisions -----------------------------------------------------------------------


def training_section(precision: Any) -> Any:
    cfg = compose_config(["training=gpt3/tiny", f"training.trainer.precision={precision}"])
    return cfg.training


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_every_precision_is_taken_by_every_reader_as_the_same_dtype(name: str) -> None:
    dtype = PRECISIONS[name]
    section = training_section(name)
    assert training.precision(section) == dtype
    layout = read_layout(OmegaConf.to_container(section, resolve=True), "")
    assert layout.dtype == dtype
    evaluation.check_precision(name, name)  # a model trained in it, evaluated as trained


@pytest.mark.parametrize("name", ["64", "bf16-true", "16-true"])
def test_a_precision_not_in_the_table_is_refused_by_every_reader(name: str) -> None:
    section = training_section(name)
    with pytest.raises(ConfigError, match="is not a precision"):
        training.precision(section)
    with pytest.raises(ConfigError, match="is not a precision"):
        read_layout(OmegaConf.to_container(section, resolve=True), "")
    with pytest.raises(ConfigError, match="is not a precision"):
        evaluation.check_precision(name, name)


def test_the_precisions_an_import_records_are_in_the_table() -> None:
    """A Hugging Face import writes its dtype as a recipe precision, which the jobs read."""
    assert {str(name) for name in HF_DTYPE_PRECISIONS.values()} <= set(PRECISIONS)


def test_32_true_is_planned_and_trains_in_fp32(tmp_path: Path) -> None:
    """The cost model took 32-true, the training recipe checks did not: the training job
    builds the same fp32 model for it as for 32."""
    import torch

    from launcher_scripts.config.preflight import resolve
    from launcher_scripts.jobs.models.transformer import transformer_config

    cfg = compose_config(
        [
            "stages=[training]",
            "training=gpt3/tiny",
            "training.trainer.precision=32-true",
            f"data_dir={tmp_path / 'data'}",
            f"base_results_dir={tmp_path / 'results'}",
            "dry_run=true",
        ]
    )
    _backend, resolved, planned = pipeline.plan(cfg)
    assert planned[0].jobs
    config = transformer_config(resolve(cfg, ["training"]).training, False, False)
    assert config.params_dtype == torch.float32 and not config.fp16 and not config.bf16
    assert resolved.training.trainer.precision == "32-true"


# ----- heads over tensor parallelism --------------------------------------------------------


def test_tp_that_does_not_split_the_heads_is_one_error_for_every_reader() -> None:
    """A model of 8 heads in 2 query groups at TP 4: the heads split, the groups do not."""
    problem = "4 does not divide the 2 query groups (key-value heads)"
    model = {"num_layers": 4, "num_attention_heads": 8, "num_query_groups": 2}
    with pytest.raises(ConfigError) as by_layout:
        require_layout(OmegaConf.create(model), 4, 1, "conversion.model")
    shape = ModelShape(4, 256, 1024, 8, 512, 1000, num_query_groups=2)
    parallel = Layout(num_nodes=1, gpus_per_node=4, tensor=4)
    with pytest.raises(ConfigError) as by_cost_model:
        check_layout(shape, parallel)
    block = OmegaConf.create(model | {"hidden_size": 256, "ffn_hidden_size": 1024})
    with pytest.raises(ConfigError) as by_recipe:
        training.check_attention(block, parallel, "training.model")
    assert by_layout.value.problem == by_cost_model.value.problem == by_recipe.value.problem
    assert by_layout.value.problem == problem
    assert by_layout.value.key == "conversion.model.tensor_model_parallel_size"
    assert by_cost_model.value.key == "model.tensor_model_parallel_size"
    assert by_recipe.value.key == "training.model.num_query_groups"


@pytest.mark.parametrize(
    ("tensor", "heads", "groups", "key", "problem"),
    [
        (3, 12, None, "m.tensor_model_parallel_size", None),
        (4, 6, None, "m.tensor_model_parallel_size", "4 does not divide the 6 attention heads"),
        (2, 8, 8, "m.tensor_model_parallel_size", None),
        (4, 8, 2, "m.num_query_groups", "4 does not divide the 2 query groups (key-value heads)"),
    ],
)
def test_the_heads_check(
    tensor: int, heads: int, groups: int | None, key: str, problem: str | None
) -> None:
    def check() -> None:
        require_heads_split(
            "m.tensor_model_parallel_size", tensor, heads, groups, groups_key="m.num_query_groups"
        )

    if problem is None:
        check()
        return
    with pytest.raises(ConfigError) as error:
        check()
    assert (error.value.key, error.value.problem) == (key, problem)


# ----- the tuning stages --------------------------------------------------------------------


def test_each_tuning_stage_is_a_stage_a_recipe_group_and_a_program() -> None:
    assert set(TUNING_STAGES) <= set(STAGES)
    assert set(TUNING_STAGES) <= set(config_groups())
    assert set(TUNING_STAGES) <= set(families.PROGRAMS)
    assert set(OPTIONAL_KEYS) == {"common", *TUNING_STAGES}


def test_no_other_stage_runs_the_tuning_program() -> None:
    tuning = {name for name, stage in STAGES.items() if isinstance(stage, TuningStage)}
    assert tuning == set(TUNING_STAGES)
