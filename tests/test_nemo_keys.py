"""The keys the NeMo launcher's reference documents: accepted with their documented meaning, or
refused with one line naming the key to use (launcher_scripts/config/nemo_keys.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher_scripts import pipeline
from launcher_scripts.config.compose import compose_config
from launcher_scripts.errors import ConfigError, LauncherError
from launcher_scripts.formats.progress import STATE_FILE
from launcher_scripts.recipes.conversion import with_tokenizer_files
from tests.support.commands import assert_one_line_error, run_main
from tests.support.dry_runs import without_slurm


def dry_plan(tmp_path: Path, *overrides: str):
    args = [f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "dry_run=true"]
    return pipeline.plan(pipeline.compose([*args, *overrides]))


def refused(tmp_path: Path, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        dry_plan(tmp_path, *overrides)
    return error.value


# ----- conversion ---------------------------------------------------------------------------

# One node: the local backend runs one machine's processes (the published recipe has 8).
GPT2_RUN = ("stages=[training,conversion]", "training=gpt3/126m", "training.trainer.num_nodes=1")


def test_conversion_packs_the_tokenizer_files_it_is_given(tmp_path: Path) -> None:
    """NeMo's conversion.model.vocab_file/merge_file: the GPT-2 BPE files where they are now."""
    vocab, merges = tmp_path / "bpe" / "vocab.json", tmp_path / "bpe" / "merges.txt"
    _, resolved, planned = dry_plan(
        tmp_path,
        *GPT2_RUN,
        f"conversion.model.vocab_file={vocab}",
        f"conversion.model.merge_file={merges}",
    )
    conversion = next(stage for stage in planned if stage.stage == "conversion")
    written = OmegaConf.create(conversion.config_yaml)
    hparams = OmegaConf.create({"tokenizer": dict(resolved.training.model.tokenizer)})
    packed = with_tokenizer_files(hparams, written.model).tokenizer
    assert (packed.vocab_file, packed.merge_file) == (str(vocab), str(merges))
    assert str(vocab) in conversion.missing_inputs  # a dry run lists what is not there yet
    unchanged = with_tokenizer_files(
        OmegaConf.create({"tokenizer": {"vocab_file": "/a", "merge_file": "/b"}}),
        OmegaConf.create({"vocab_file": None, "merge_file": None}),
    )
    assert (unchanged.tokenizer.vocab_file, unchanged.tokenizer.merge_file) == ("/a", "/b")


def test_conversion_tokenizer_files_for_a_sentencepiece_model_are_refused(tmp_path: Path) -> None:
    error = refused(
        tmp_path, "stages=[training,conversion]", "conversion.model.vocab_file=/x/vocab.json"
    )
    assert error.key == "conversion.model.vocab_file" and "=null" in str(error), str(error)


def test_conversion_tokenizer_files_must_exist_in_a_real_run(tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    # A saved checkpoint (its state file; no file sizes recorded): preflight's checkpoint
    # check passes, so the tokenizer file is what is refused.
    (checkpoints / "megatron_gpt--step=2").mkdir(parents=True)
    (checkpoints / "megatron_gpt--step=2" / STATE_FILE).write_text(json.dumps({"step": 2}))
    hparams = tmp_path / "run" / "hparams.yaml"
    tokenizer = {"library": "megatron", "type": "GPT2BPETokenizer", "vocab_file": "/old/v.json"}
    OmegaConf.save(
        {"cfg": {"num_layers": 2, "num_attention_heads": 2, "tokenizer": tokenizer}}, hparams
    )
    missing = tmp_path / "moved" / "vocab.json"
    result = run_main(
        f"base_results_dir={tmp_path}/results",
        "stages=[conversion]",
        f"conversion.model.checkpoint_folder={checkpoints}",
        f"conversion.model.hparams_file={hparams}",
        "conversion.run.hf_dir_name=null",
        f"conversion.model.vocab_file={missing}",
    )
    assert_one_line_error(result, "conversion.model.vocab_file", f"{missing} does not exist")
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("stage", ["conversion", "evaluation"])
def test_model_parallel_size_is_tp_times_pp(stage: str, tmp_path: Path) -> None:
    stages = "stages=[training,conversion,evaluation]"
    dry_plan(tmp_path, stages, f"{stage}.model.tensor_model_parallel_size=2")  # follows TP x PP
    error = refused(tmp_path, stages, f"{stage}.model.model_parallel_size=4")
    assert error.key == f"{stage}.model.model_parallel_size", str(error)
    assert f"{stage}.model.tensor_model_parallel_size" in str(error)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("+conversion.run.nodes=2", "one process"),
        ("+conversion.run.ntasks_per_node=8", "one process"),
        ("+evaluation.run.nodes=2", "evaluation.model.tensor_model_parallel_size"),
        ("evaluation.run.ntasks_per_node=8", "evaluation.model.tensor_model_parallel_size"),
    ],
)
def test_nemos_resource_keys_are_refused_with_what_to_use(
    override: str, fragment: str, tmp_path: Path
) -> None:
    stages = "stages=[training,conversion,evaluation,export]"
    error = refused(tmp_path, stages, override)
    assert error.key == override.lstrip("+").partition("=")[0], str(error)
    assert "NeMo" in str(error) and fragment in str(error), str(error)


@pytest.mark.parametrize(
    ("override", "fix"),
    [
        ("+export.model.weight_data_type=fp16", "precision it was trained and converted in"),
        ("+export.triton_deployment.data_type=bf16", "precision it was trained and converted in"),
        ("+export.triton_deployment.int8_mode=False", "int8 weights are not served here"),
        ("+export.triton_deployment.enable_custom_all_reduce=False", "NCCL"),
        ("+export.model.processes=16", "one process"),
        ("+export.model.load_checkpoints_to_cpu=False", "reads the converted file"),
        ("+export.triton_deployment.triton_model_dir=/r", "model_repository and model_name"),
    ],
)
def test_fastertransformer_export_keys_say_what_serves_instead(
    override: str, fix: str, tmp_path: Path
) -> None:
    """Section 5.14's FasterTransformer keys: one line each, not "no program reads it"."""
    error = refused(tmp_path, "stages=[training,conversion,export]", override)
    assert error.key == override.lstrip("+").partition("=")[0], str(error)
    assert "FasterTransformer" in str(error) and fix in str(error), str(error)


# ----- evaluation ---------------------------------------------------------------------------


def test_the_interleaved_evaluation_override_runs(tmp_path: Path) -> None:
    """5.13.1.4: evaluate a converted file, nulling NeMo's checkpoint keys."""
    model = tmp_path / "converted.nemo"
    _, resolved, _ = dry_plan(
        tmp_path,
        "stages=[evaluation]",
        f"evaluation.model.nemo_model={model}",
        "evaluation.model.checkpoint_folder=null",
        "evaluation.model.checkpoint_name=null",
        "evaluation.model.hparams_file=null",
    )
    assert resolved.evaluation.model.nemo_model == str(model)


@pytest.mark.parametrize("key", ["checkpoint_name", "hparams_file", "vocab_file", "merge_file"])
def test_a_checkpoints_keys_need_the_checkpoint(key: str, tmp_path: Path) -> None:
    """5.13.1's keys describe the checkpoint model.checkpoint_folder names; without it they
    would be ignored (a converted file holds its tokenizer)."""
    error = refused(tmp_path, "stages=[evaluation]", f"evaluation.model.{key}=/some/path")
    assert error.key == f"evaluation.model.{key}" and "checkpoint_folder" in str(error), error


def test_evaluating_a_checkpoint_directly_converts_it_first(tmp_path: Path) -> None:
    """5.13.1.3's evaluation.model.checkpoint_folder: the stage's first job converts it."""
    _, resolved, planned = dry_plan(
        tmp_path,
        "stages=[evaluation]",
        f"evaluation.model.checkpoint_folder={tmp_path}/run/results/checkpoints",
    )
    convert, evaluate = planned[0].jobs
    assert convert.spec.name.startswith("convert_") and "--output=" in convert.script
    folder = Path(str(resolved.evaluation.run.results_dir))
    assert str(folder / "converted" / "model.nemo") in evaluate.spec.reads


def test_nemos_name_of_the_tuned_file_names_this_recipes(tmp_path: Path) -> None:
    error = refused(
        tmp_path,
        "stages=[evaluation]",
        "evaluation=prompt_gpt3/squad",
        "evaluation.model.nemo_model=/r/megatron_gpt_prompt.nemo",
    )
    assert error.key == "evaluation.model.nemo_model"
    assert "model.virtual_prompt_model_file" in str(error), str(error)


# ----- data preparation ---------------------------------------------------------------------

PILES = ["gpt3/download_gpt3_pile", "t5/download_t5_pile", "bert/download_bert_pile"]


@pytest.mark.parametrize("recipe", PILES)
def test_the_pile_array_names_the_shards_of_file_numbers(recipe: str, tmp_path: Path) -> None:
    base = ("stages=[data_preparation]", f"data_preparation={recipe}")
    dry_plan(tmp_path, *base, "data_preparation.run.array=0-3", "data_preparation.file_numbers=0-3")
    error = refused(tmp_path, *base, "data_preparation.run.array=0-3")
    assert error.key == "data_preparation.run.array"
    assert "data_preparation.file_numbers=0-3" in str(error), str(error)


@pytest.mark.parametrize("recipe", PILES)
@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("data_preparation.run.bcp_preproc_npernode=2", "data_preparation.run.workers_per_node"),
        ("+data_preparation.bcp_preproc_npernode=2", "data_preparation.run.workers_per_node"),
        ("+data_preparation.nodes=30", "data_preparation.run.node_array_size"),
    ],
)
def test_nemos_pile_keys_name_this_launchers(
    recipe: str, override: str, fragment: str, tmp_path: Path
) -> None:
    error = refused(tmp_path, "stages=[data_preparation]", f"data_preparation={recipe}", override)
    assert fragment in str(error), str(error)


def test_bert_merges_save_dir_is_accepted(tmp_path: Path) -> None:
    dry_plan(
        tmp_path,
        "stages=[data_preparation]",
        "data_preparation=bert/download_bert_pile",
        f"data_preparation.merges_save_dir={tmp_path}/bpe",
    )


# ----- T5 position embeddings ----------------------------------------------------------------

ONE_NODE = "training.trainer.num_nodes=1"  # the local backend runs one machine's processes


@pytest.mark.parametrize("recipe", ["t5/220m", "mt5/390m"])
def test_t5_position_embedding_type_sets_both_blocks(recipe: str, tmp_path: Path) -> None:
    _, resolved, _ = dry_plan(
        tmp_path,
        "stages=[training]",
        f"training={recipe}",
        ONE_NODE,
        "training.model.position_embedding_type=relative",
    )
    model = resolved.training.model
    assert model.encoder.position_embedding_type == "relative"
    assert model.decoder.position_embedding_type == "relative"


# megatron-core's T5Model's own values where a recipe leaves the model's out.
T5_POSITION_DEFAULTS = {
    "position_embedding_type": "learned_absolute",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
}


@pytest.mark.parametrize("recipe", ["t5/220m", "t5/tiny", "mt5/390m"])
@pytest.mark.parametrize("block", ["encoder", "decoder"])
@pytest.mark.parametrize("name", sorted(T5_POSITION_DEFAULTS))
def test_t5_block_position_settings_other_than_the_models_are_refused(
    recipe: str, block: str, name: str, tmp_path: Path
) -> None:
    """megatron-core's T5Model takes one position setting for both blocks: a block's other
    value would be ignored by the job, and recorded in the model's config as if it were not."""
    _, resolved, _ = dry_plan(tmp_path, "stages=[training]", f"training={recipe}", ONE_NODE)
    used = resolved.training.model.get(name, T5_POSITION_DEFAULTS[name])
    if name == "position_embedding_type":
        other = "learned_absolute" if used == "relative" else "relative"
    else:
        other = int(used) // 2
    error = refused(
        tmp_path,
        "stages=[training]",
        f"training={recipe}",
        ONE_NODE,
        f"training.model.{block}.{name}={other}",
    )
    assert error.key == f"training.model.{block}.{name}", str(error)
    assert f"model.{name} {used!r}" in error.problem and "both blocks" in error.problem


@pytest.mark.parametrize("value", ["alibi", "bogus", "rope"])
@pytest.mark.parametrize(
    "where", ["model", "model.encoder", "model.decoder"], ids=["top", "encoder", "decoder"]
)
def test_t5_position_embedding_type_is_validated(value: str, where: str, tmp_path: Path) -> None:
    error = refused(
        tmp_path,
        "stages=[training]",
        "training=t5/220m",
        f"training.{where}.position_embedding_type={value}",
    )
    assert error.key == f"training.{where}.position_embedding_type", str(error)
    assert "learned_absolute, relative" in str(error)


def test_t5_relative_bias_sizes_are_whole_numbers(tmp_path: Path) -> None:
    error = refused(
        tmp_path,
        "stages=[training]",
        "training=t5/220m",
        "training.model.position_embedding_type=relative",
        "training.model.relative_attention_num_buckets=many",
    )
    assert error.key == "training.model.relative_attention_num_buckets", str(error)


def test_bert_position_embedding_type_is_validated(tmp_path: Path) -> None:
    error = refused(
        tmp_path,
        "stages=[training]",
        "training=bert/110m",
        "training.model.position_embedding_type=alibi",
    )
    assert error.key == "training.model.position_embedding_type", str(error)


# ----- names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "group", "recipe"),
    [
        ("conversion=convert_t5", "conversion", "t5/convert_t5"),
        ("conversion=convert_mt5", "conversion", "mt5/convert_mt5"),
        ("data_preparation=custom_dataset", "data_preparation", "generic/custom_dataset"),
        ("training=126m", "training", "gpt3/126m"),
    ],
)
def test_a_recipes_file_name_alone_names_it_when_unique(
    given: str, group: str, recipe: str
) -> None:
    assert compose_config([given])[group] == compose_config([f"{group}={recipe}"])[group]


def test_an_ambiguous_file_name_lists_the_recipes() -> None:
    with pytest.raises(LauncherError, match="prompt_gpt3/squad"):
        compose_config(["evaluation=squad"])


def test_interactive_runs_as_local(tmp_path: Path) -> None:
    """NeMo's `cluster_type=interactive`: the jobs run on the node one is logged in to."""
    backend, resolved, planned = dry_plan(tmp_path, "cluster_type=interactive")
    _, _, local = dry_plan(tmp_path, "cluster_type=local")
    assert backend.name == "local" and resolved.cluster_type == "local"
    scripts = [[job.script for job in stage.jobs] for stage in planned]
    assert scripts == [[job.script for job in stage.jobs] for stage in local]


def test_a_container_is_refused_where_no_container_starts(tmp_path: Path) -> None:
    """Local (and interactive) jobs run with this machine's Python: NeMo's conf/config.yaml
    names a container, which would otherwise be dropped without a word."""
    for cluster_type in ("local", "interactive"):
        result = run_main(
            f"base_results_dir={tmp_path}/r",
            f"cluster_type={cluster_type}",
            "container=nvcr.io/nvidia/nemo:24.05",
            "dry_run=true",
        )
        assert_one_line_error(result, "container", "starts no container", "container=null")
    mounts = refused(tmp_path, "container_mounts=[/lustre]")
    assert mounts.key == "container_mounts"


def test_nemos_cluster_bcm_is_ignored_for_bcp(tmp_path: Path) -> None:
    """5.1.1.3: 'cluster: bcm  # Leave it as bcm even if using bcp. It will be ignored.'"""
    image = "container=nvcr.io/nvidia/nemo:24.05"
    backend, resolved, _ = dry_plan(tmp_path, "cluster=bcm", "cluster_type=bcp", image)
    assert backend.name == "bcp" and resolved.cluster.instance  # the bcp file's key
    # Any other shipped file of another type still says what it would do.
    error = refused(tmp_path, "cluster=bcm", "cluster_type=k8s", image)
    assert error.key == "cluster" and "cluster_type=k8s" in str(error)


def test_an_env_var_is_added_without_the_plus(tmp_path: Path) -> None:
    """NeMo's pages write `env_vars.NAME=value`; Hydra alone asks for `+env_vars.NAME`."""
    _, _, planned = dry_plan(tmp_path, "env_vars.MY_SETTING=a b", "env_vars.NCCL_TOPO_FILE=/t.xml")
    script = planned[0].jobs[0].script
    assert "export MY_SETTING='a b'" in script and "export NCCL_TOPO_FILE=/t.xml" in script


@pytest.mark.parametrize("cluster_type", ["bcm", "bcp", "k8s"])
def test_more_gpus_per_node_than_a_node_has_is_refused_in_the_dry_run(
    cluster_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slurm would pend `--gpus-per-node=16` forever on 8-GPU nodes; a pod would never be
    placed. Training asks for trainer.devices; evaluation for TP x PP on one node."""
    without_slurm(monkeypatch)  # the recipe's 8 nodes, not this machine's Slurm partition
    extra = ["container=nvcr.io/nvidia/nemo:24.05"]
    if cluster_type == "k8s":
        extra.append("cluster.volumes=[{name: w, mount_path: /, host_path: /}]")
    training = refused(
        tmp_path,
        f"cluster_type={cluster_type}",
        "training=gpt3/126m",
        "training.trainer.devices=16",
        "training.model.global_batch_size=512",
        *extra,
    )
    assert training.key == "training.trainer.devices"
    assert "needs 16 GPUs on each node but cluster.gpus_per_node is 8" in str(training)
    evaluation = refused(
        tmp_path,
        f"cluster_type={cluster_type}",
        "stages=[evaluation]",
        "evaluation=gpt3/evaluate_all",
        "training=gpt3/126m",
        "evaluation.model.tensor_model_parallel_size=4",
        "evaluation.model.pipeline_model_parallel_size=4",
        *extra,
    )
    assert evaluation.key == "evaluation.model.tensor_model_parallel_size"
    # Within a node it renders.
    dry_plan(tmp_path, f"cluster_type={cluster_type}", "training=gpt3/126m", *extra)


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("git_lfs_dir", "working folders"),
        ("max_split_size", "size in GB"),
        ("preprocess_worker_mapping", "mapping mC4 files to workers"),
    ],
)
def test_nemos_mc4_keys_are_refused_for_what_they_are(key: str, says: str, tmp_path: Path) -> None:
    result = run_main(
        f"base_results_dir={tmp_path}/r",
        "stages=[data_preparation]",
        "data_preparation=mt5/download_mc4",
        f"+data_preparation.{key}=1",
        "dry_run=true",
    )
    assert_one_line_error(result, f"data_preparation.{key}", says)
