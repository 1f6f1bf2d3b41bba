"""The T5, mT5 and BERT training recipes, and every recipe of every stage group.

Training: the published numbers pinned, the numbers consistent with each other, one key set per
family (a misspelt key would otherwise be silently ignored), the data the data-preparation
recipes write. Every group: each recipe names its model family, composes and resolves with the
root config, and reads the files the stage before it writes. Nothing is trained, rendered or
submitted; new recipes are picked up by the globs; nothing here needs a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from omegaconf import DictConfig, OmegaConf

from launcher_scripts.clusters.base import time_limit_seconds
from launcher_scripts.config.compose import compose_config, conf_dir, recipe_options
from launcher_scripts.config.preflight import resolve
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.training import parse_max_time
from tests.support.recipe_fills import FILLS

DATA_DIR, RESULTS_DIR = "/data", "/results"
PATHS = (f"data_dir={DATA_DIR}", f"base_results_dir={RESULTS_DIR}")

FAMILY_DIRS = ("t5", "mt5", "bert")  # conf/training/<dir>: the recipes this file pins
TRAINING = [  # the published sizes; the CPU recipes (tiny) are tested where they train
    f"{family}/{path.stem}"
    for family in FAMILY_DIRS
    for path in sorted((conf_dir() / "training" / family).glob("*.yaml"))
    if not path.stem.startswith("tiny")  # tiny, tiny_moe
]
SMALLEST = {"t5": "t5/220m", "mt5": "mt5/170m", "bert": "bert/110m"}
MT5_EXTRA_KEYS = {"run.preprocessed_dir", "run.blending_alpha"}  # mT5's keys beyond T5's

STAGE_GROUPS = (
    "training",
    "conversion",
    "fine_tuning",
    "peft",
    "prompt_learning",
    "adapter_learning",
    "ia3_learning",
    "evaluation",
    "export",
)
ALL_RECIPES = [(group, recipe) for group in STAGE_GROUPS for recipe in recipe_options(group)]

# The mC4 languages the published mT5 data preparation downloads (README 5.1.2.3).
# fmt: off
MC4_LANGUAGES = [
    "cs", "da", "de", "el", "en", "es", "fi", "fr", "hi", "hu", "it", "ja",
    "ko", "lt", "lv", "nl", "no", "pl", "pt", "ro", "ru", "sk", "sv", "zh",
]
# fmt: on


def t5(
    *,
    nodes: int,
    tp: int,
    pp: int,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    mbs: int,
    gbs: int,
) -> dict[str, Any]:
    """A T5/mT5 row of the README: encoder and decoder alike, GeGLU, 512-token inputs."""
    block = {
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        "activation": "geglu",
    }
    return {
        "trainer.num_nodes": nodes,
        "trainer.devices": 8,
        "trainer.precision": "bf16",
        "model.tensor_model_parallel_size": tp,
        "model.pipeline_model_parallel_size": pp,
        **{
            f"model.{part}.{key}": value
            for part in ("encoder", "decoder")
            for key, value in block.items()
        },
        "model.seq_length": 512,
        "model.micro_batch_size": mbs,
        "model.global_batch_size": gbs,
        "model.optim.name": "distributed_fused_adam",
    }


def bert(
    *,
    nodes: int,
    tp: int,
    pp: int,
    sp: bool,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    mbs: int,
    gbs: int,
) -> dict[str, Any]:
    """A BERT row of the README (section 5.2.5) with the launcher YAML's layout and batches."""
    return {
        "trainer.num_nodes": nodes,
        "trainer.devices": 8,
        "trainer.precision": "bf16",
        "model.tensor_model_parallel_size": tp,
        "model.pipeline_model_parallel_size": pp,
        "model.sequence_parallel": sp,
        "model.num_layers": layers,
        "model.hidden_size": hidden,
        "model.ffn_hidden_size": ffn,
        "model.num_attention_heads": heads,
        "model.activation": "geglu",
        "model.encoder_seq_length": 512,
        "model.micro_batch_size": mbs,
        "model.global_batch_size": gbs,
        "model.optim.name": "distributed_fused_adam",
    }


# The numbers the NeMo launcher publishes (README 5.2.2, 5.2.3, 5.2.5; batch sizes and the BERT
# node counts and parallelism from its recipe files, which the README does not list).
PUBLISHED: dict[str, dict[str, Any]] = {
    "t5/220m": t5(nodes=4, tp=1, pp=1, layers=12, hidden=768, ffn=2048, heads=12, mbs=64, gbs=2048),
    "t5/3b": t5(nodes=20, tp=2, pp=1, layers=24, hidden=2048, ffn=5120, heads=32, mbs=24, gbs=1920),
    "t5/11b": t5(
        nodes=20, tp=4, pp=1, layers=24, hidden=4096, ffn=10240, heads=64, mbs=24, gbs=1920
    ),
    "t5/23b": t5(
        nodes=40, tp=4, pp=2, layers=36, hidden=5120, ffn=10880, heads=64, mbs=8, gbs=1920
    ),
    "t5/41b": t5(
        nodes=40, tp=4, pp=2, layers=36, hidden=6144, ffn=10880, heads=96, mbs=6, gbs=1920
    ),
    "mt5/170m": t5(nodes=4, tp=1, pp=1, layers=8, hidden=512, ffn=1024, heads=6, mbs=64, gbs=2048),
    "mt5/390m": t5(nodes=8, tp=1, pp=1, layers=8, hidden=512, ffn=2048, heads=12, mbs=32, gbs=2048),
    "mt5/3b": t5(
        nodes=20, tp=2, pp=1, layers=24, hidden=2048, ffn=5120, heads=32, mbs=24, gbs=1920
    ),
    "bert/110m": bert(
        nodes=8, tp=1, pp=1, sp=False, layers=12, hidden=768, ffn=3072, heads=12, mbs=4, gbs=256
    ),
    "bert/4b": bert(
        nodes=16, tp=1, pp=1, sp=False, layers=48, hidden=2560, ffn=10240, heads=40, mbs=8, gbs=2048
    ),
    "bert/20b": bert(
        nodes=32, tp=4, pp=4, sp=True, layers=48, hidden=6144, ffn=24576, heads=96, mbs=4, gbs=4096
    ),
    "bert/100b": bert(
        nodes=128,
        tp=4,
        pp=16,
        sp=True,
        layers=96,
        hidden=9216,
        ffn=36864,
        heads=96,
        mbs=8,
        gbs=4096,
    ),
}

# What each evaluation recipe is: (evaluation_kind, peft_method).
EVALUATIONS: dict[str, tuple[str, str | None]] = {
    "gpt3/evaluate_all": ("harness", None),
    "t5/squad": ("fine_tuned", None),
    "mt5/xquad": ("fine_tuned", None),
    "prompt_gpt3/squad": ("fine_tuned", "prompt"),
    "adapter_gpt3/squad": ("fine_tuned", "adapter"),
    "ia3_gpt3/squad": ("fine_tuned", "ia3"),
    "peft_gpt3/squad": ("fine_tuned", "lora"),
    "prompt_t5/squad": ("fine_tuned", "prompt"),
    "adapter_t5/squad": ("fine_tuned", "adapter"),
    "prompt_mt5/squad": ("fine_tuned", "prompt"),
    "ia3_t5/squad": ("fine_tuned", "ia3"),
}

# Recipes the issue asks for beyond the training sizes in PUBLISHED.
REQUESTED = {
    "conversion": {"gpt3/convert_gpt3", "t5/convert_t5", "mt5/convert_mt5"},
    "fine_tuning": {
        "gpt3/squad",
        "t5/squad",
        "mt5/xquad",
        "gpt3/custom_task",
        "t5/custom_task",
        "mt5/custom_task",
    },
    "peft": {"gpt3/squad"},
    "prompt_learning": {"gpt3/squad", "t5/squad", "mt5/squad"},
    "adapter_learning": {"gpt3/squad", "t5/squad", "mt5/squad"},
    "ia3_learning": {"gpt3/squad", "t5/squad", "mt5/squad"},
    "evaluation": set(EVALUATIONS),
    "export": {"gpt3/export_gpt3"},
}


def composed(*overrides: str) -> DictConfig:
    """The root config with the overrides, every stage group named in them resolved."""
    named = [o.partition("=")[0] for o in overrides]
    groups = [group for group in ("data_preparation", *STAGE_GROUPS) if group in named]
    return resolve(compose_config([*overrides, *PATHS]), groups)


@functools.cache
def training(recipe: str) -> DictConfig:
    """The training recipe composed as main.py composes it, resolved (read only)."""
    return composed(f"training={recipe}").training


def flat_keys(node: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in node.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= flat_keys(value, f"{prefix}{key}.")
    return keys


def keys_of(recipe: str) -> set[str]:
    return flat_keys(OmegaConf.to_container(training(recipe)))


def blocks(model: DictConfig) -> list[DictConfig]:
    """The transformer stacks: T5's encoder and decoder, or BERT's single one."""
    return [model.encoder, model.decoder] if "encoder" in model else [model]


def expected_family(recipe: str) -> str:
    """The family a recipe's folder names: gpt3, prompt_gpt3, ... | t5, mt5, adapter_t5 | bert;
    hf_import's is its directory's, hf_export's its file's; Llama, Mistral, Qwen2 (and
    Qwen2-MoE), Mixtral and DeepSeekMoE are GPT."""
    if recipe in ("hf_import", "hf_export"):
        return "auto"  # the family importing the directory's config.json model_type
    folder = recipe.split("/")[0]
    markers = (("gpt", "gpt"), ("llama", "gpt"), ("mistral", "gpt"), ("qwen", "gpt"))
    markers += (("mixtral", "gpt"), ("deepseek", "gpt"))
    for marker, family in (*markers, ("bert", "bert"), ("t5", "t5")):
        if marker in folder:
            return family
    raise AssertionError(f"{recipe}: no model family in its folder name")


# ---------------------------------------------------------------- training recipes


def test_the_globs_find_the_published_recipes() -> None:
    assert sorted(PUBLISHED) == sorted(TRAINING)


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_published_numbers(recipe: str) -> None:
    cfg = training(recipe)
    actual = {key: OmegaConf.select(cfg, key) for key in PUBLISHED[recipe]}
    assert actual == PUBLISHED[recipe]
    family, size = recipe.split("/")
    assert cfg.run.name == f"{family}_{size}"
    assert cfg.model_family == ("bert" if family == "bert" else "t5")


@pytest.mark.parametrize("recipe", TRAINING)
def test_recipe_numbers_are_consistent(recipe: str) -> None:
    cfg = training(recipe)
    model, trainer = cfg.model, cfg.trainer
    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    world = trainer.num_nodes * trainer.devices
    assert world % (tp * pp) == 0, f"TP x PP does not divide {world} GPUs"
    per_step = model.micro_batch_size * world // (tp * pp)
    assert model.global_batch_size % per_step == 0, f"GBS is not a multiple of MBS x DP {per_step}"
    for block in blocks(model):
        assert block.num_attention_heads % tp == 0
        if block.kv_channels is None:
            assert block.hidden_size % block.num_attention_heads == 0
        for value in (block.init_method_std, block.hidden_dropout, block.attention_dropout):
            assert isinstance(value, float), value  # YAML 1.1 reads "1e-4" as a string
    assert model.virtual_pipeline_model_parallel_size is None
    if model.sequence_parallel:
        assert tp >= 2 and model.data.seq_length % tp == 0
    if cfg.model_family == "t5":
        check_t5_layout(model, pp)
    else:
        assert model.num_layers % pp == 0
        assert model.data.seq_length == model.encoder_seq_length
    assert model.data.seq_length <= model.max_position_embeddings
    assert isinstance(model.data.masked_lm_prob, float) and 0 < model.data.masked_lm_prob < 1
    check_schedule(cfg)
    assert parse_max_time(trainer.max_time) <= time_limit_seconds(
        cfg.run.time_limit, "training.run.time_limit"
    )


def check_t5_layout(model: DictConfig, pp: int) -> None:
    """The encoder runs on the pipeline stages before the split rank, the decoder on the last
    (megatron-core hands one tensor between stages)."""
    split = model.pipeline_model_parallel_split_rank
    if pp == 1:
        assert split == 0
    else:
        assert split == pp - 1
        assert model.encoder.num_layers % split == 0
    assert model.encoder.hidden_size == model.decoder.hidden_size  # cross-attention needs it
    assert model.data.seq_length == model.seq_length
    assert model.data.seq_length_dec <= model.max_position_embeddings
    assert model.tokenizer.num_sentinel_tokens > 0


def check_schedule(cfg: DictConfig) -> None:
    optim = cfg.model.optim
    values = [optim.lr, optim.sched.min_lr, optim.weight_decay]
    if "eps" in optim:
        values.append(optim.eps)
    for value in values:
        assert isinstance(value, float), value  # YAML 1.1 reads "1e-4" as a string
    assert optim.sched.min_lr <= optim.lr
    if optim.sched.name == "WarmupAnnealing":
        assert 0 < optim.sched.warmup_ratio < 1
    else:
        assert optim.sched.name == "CosineAnnealing"
        assert cfg.trainer.max_steps > optim.sched.warmup_steps + optim.sched.constant_steps


@pytest.mark.parametrize("recipe", TRAINING)
def test_recipe_has_its_familys_keys(recipe: str) -> None:
    """The same key set as the family's smallest recipe: no missing or misspelt key."""
    template = keys_of(SMALLEST[recipe.split("/")[0]])
    keys = keys_of(recipe)
    assert template - keys == set(), "missing"
    assert keys - template == set(), "unknown"


def test_mt5_recipes_have_the_t5_keys_and_the_language_blend() -> None:
    t5_keys, mt5_keys = keys_of(SMALLEST["t5"]), keys_of(SMALLEST["mt5"])
    assert mt5_keys - t5_keys == MT5_EXTRA_KEYS
    assert t5_keys - mt5_keys == set()


def test_training_run_names_are_distinct() -> None:
    """Each recipe writes to base_results_dir/<run.name>: two recipes must not share one."""
    recipes = recipe_options("training")
    names = [training(recipe).run.name for recipe in recipes]
    assert len(set(names)) == len(names), names


@pytest.mark.parametrize("recipe", [r for r in TRAINING if r.startswith("t5/")])
def test_t5_reads_the_t5_pile_shards(recipe: str) -> None:
    data, tokenizer = training(recipe).model.data, training(recipe).model.tokenizer
    weights, prefixes = list(data.data_prefix[::2]), list(data.data_prefix[1::2])
    assert prefixes == [f"{DATA_DIR}/my-t5_{n:02d}_text_document" for n in range(30)]
    assert all(isinstance(w, float) for w in weights) and abs(sum(weights) - 1) < 1e-3
    assert (tokenizer.library, tokenizer.type) == ("megatron", "BertWordPieceCase")
    assert tokenizer.vocab_file == f"{DATA_DIR}/bpe/vocab.txt"
    assert data.dataset_type == "t5"


@pytest.mark.parametrize("recipe", [r for r in TRAINING if r.startswith("bert/")])
def test_bert_reads_the_sentence_split_pile_shards(recipe: str) -> None:
    data, tokenizer = training(recipe).model.data, training(recipe).model.tokenizer
    weights, prefixes = list(data.data_prefix[::2]), list(data.data_prefix[1::2])
    assert prefixes == [f"{DATA_DIR}/my-bert_{n:02d}_text_sentence" for n in range(30)]
    assert all(isinstance(w, float) for w in weights) and abs(sum(weights) - 1) < 1e-3
    assert (tokenizer.library, tokenizer.type) == ("megatron", "BertWordPieceLowerCase")
    # Apart from T5's cased vocabulary (bpe/vocab.txt), so both can share one data_dir.
    assert tokenizer.vocab_file == f"{DATA_DIR}/bpe_uncased/vocab.txt"


@pytest.mark.parametrize("recipe", [r for r in TRAINING if r.startswith("mt5/")])
def test_mt5_blends_the_mc4_languages(recipe: str) -> None:
    cfg = training(recipe)
    # Paths without weights: the job weights the languages by size ** blending_alpha.
    assert list(cfg.model.data.data_prefix) == [
        f"{DATA_DIR}/mc4/preprocessed/mc4_{language}_text_document" for language in MC4_LANGUAGES
    ]
    assert cfg.run.preprocessed_dir == f"{DATA_DIR}/mc4/preprocessed"
    alpha = cfg.run.blending_alpha
    assert isinstance(alpha, float) and 0 <= alpha <= 1
    tokenizer = cfg.model.tokenizer
    assert (tokenizer.library, tokenizer.model) == (
        "sentencepiece",
        f"{DATA_DIR}/mc4/bpe/mt5_tokenizer.model",
    )


PILE_DATA = {
    "t5": ("t5/download_t5_pile", "text_document"),
    "bert": ("bert/download_bert_pile", "text_sentence"),
}


@pytest.mark.parametrize("recipe", [r for r in TRAINING if not r.startswith("mt5/")])
def test_pile_recipes_read_what_their_data_preparation_writes(recipe: str) -> None:
    family = recipe.split("/")[0]
    prep_recipe, kind = PILE_DATA[family]
    cfg = composed(f"training={recipe}", f"data_preparation={prep_recipe}")
    prep, model = cfg.data_preparation, cfg.training.model
    assert model.tokenizer.vocab_file == f"{prep.vocab_save_dir}/vocab.txt"
    assert model.tokenizer.type == prep.tokenizer_type
    assert list(model.data.data_prefix[1::2]) == [
        f"{DATA_DIR}/{prep.output_prefix}{n:02d}_{kind}" for n in range(30)
    ]


@pytest.mark.parametrize("recipe", [r for r in TRAINING if r.startswith("mt5/")])
def test_mt5_reads_what_the_mc4_preparation_writes(recipe: str) -> None:
    cfg = composed(f"training={recipe}", "data_preparation=mt5/download_mc4")
    prep, train = cfg.data_preparation, cfg.training
    languages = prep.languages.split(",") if isinstance(prep.languages, str) else prep.languages
    assert list(train.model.data.data_prefix) == [
        f"{prep.preprocessed_dir}/mc4_{language}_text_document" for language in languages
    ]
    assert train.model.tokenizer.model == prep.tokenizer_model


def test_a_blending_override_reaches_every_language() -> None:
    cfg = composed("training=mt5/170m", "training.run.preprocessed_dir=/elsewhere").training
    assert all(prefix.startswith("/elsewhere/mc4_") for prefix in cfg.model.data.data_prefix)


# ---------------------------------------------------------------- every group


@pytest.mark.parametrize(("group", "recipes"), sorted(REQUESTED.items()))
def test_the_requested_recipes_exist(group: str, recipes: set[str]) -> None:
    assert recipes <= set(recipe_options(group))


@pytest.mark.parametrize(("group", "recipe"), ALL_RECIPES)
def test_recipe_names_its_model_family(group: str, recipe: str) -> None:
    """The launcher picks the job program by `model_family`: every recipe must say it."""
    raw = OmegaConf.load(conf_dir() / group / f"{recipe}.yaml")
    assert raw.get("model_family") == expected_family(recipe)


@pytest.mark.parametrize("recipe", recipe_options("evaluation"))
def test_evaluation_recipe_names_its_kind(recipe: str) -> None:
    cfg = composed(f"evaluation={recipe}").evaluation
    assert cfg.evaluation_kind in ("harness", "fine_tuned")
    assert cfg.get("peft_method") in (None, "prompt", "adapter", "ia3", "lora")
    if recipe in EVALUATIONS:
        assert (cfg.evaluation_kind, cfg.get("peft_method")) == EVALUATIONS[recipe]
    if cfg.evaluation_kind == "fine_tuned":
        assert set(cfg.metrics) == {"exact_match", "f1"}
        assert str(cfg.run.results_dir).startswith(RESULTS_DIR)


@pytest.mark.parametrize(("group", "recipe"), ALL_RECIPES)
def test_every_recipe_composes_and_resolves(group: str, recipe: str) -> None:
    cfg = composed(f"{group}={recipe}", *FILLS.get((group, recipe), []))[group]
    assert cfg.run.name and cfg.run.time_limit
    assert str(cfg.run.results_dir).startswith(RESULTS_DIR)


@pytest.mark.parametrize(("group", "recipe"), sorted(FILLS))
def test_each_value_left_to_the_user_is_asked_for(group: str, recipe: str) -> None:
    """Leaving out any one of the fills names exactly that key."""
    fills = FILLS[(group, recipe)]
    for left_out in fills:
        given = [fill for fill in fills if fill != left_out]
        with pytest.raises(ConfigError) as error:
            composed(f"{group}={recipe}", *given)
        assert error.value.key == left_out.partition("=")[0]


# ---------------------------------------------------------------- stage chains


def converted(cfg: DictConfig) -> str:
    return f"{cfg.conversion.run.output_path}/{cfg.conversion.run.nemo_file_name}"


def saved_at_train_end(group: str) -> Callable[[DictConfig], str]:
    """The .nemo a tuning run saves at its end: checkpoints/<exp_manager.name>.nemo."""
    return lambda cfg: (
        f"{cfg[group].exp_manager.explicit_log_dir}/checkpoints/{cfg[group].exp_manager.name}.nemo"
    )


# (overrides, what the earlier stage writes, the key the later stage reads it from)
CHAINS: list[tuple[list[str], Callable[[DictConfig], str], str]] = [
    *[
        (
            [f"training={train}", f"conversion={convert}"],
            lambda cfg: f"{cfg.training.exp_manager.explicit_log_dir}/checkpoints",
            "conversion.model.checkpoint_folder",
        )
        for train, convert in (("t5/220m", "t5/convert_t5"), ("mt5/390m", "mt5/convert_mt5"))
    ],
    *[
        ([f"training={train}", f"conversion={convert}", f"{group}={recipe}"], converted, key)
        for train, convert, tuning in (
            ("t5/220m", "t5/convert_t5", "t5"),
            ("mt5/390m", "mt5/convert_mt5", "mt5"),
            ("gpt3/126m", "gpt3/convert_gpt3", "gpt3"),
        )
        for group, recipe, key in (
            ("fine_tuning", f"{tuning}/custom_task", "fine_tuning.model.restore_from_path"),
            ("prompt_learning", f"{tuning}/squad", "prompt_learning.model.language_model_path"),
            ("adapter_learning", f"{tuning}/squad", "adapter_learning.model.language_model_path"),
            ("ia3_learning", f"{tuning}/squad", "ia3_learning.model.language_model_path"),
        )
    ],
    (
        ["training=t5/220m", "conversion=t5/convert_t5", "fine_tuning=t5/squad"],
        converted,
        "fine_tuning.model.restore_from_path",
    ),
    (
        ["training=mt5/390m", "conversion=mt5/convert_mt5", "fine_tuning=mt5/xquad"],
        converted,
        "fine_tuning.model.restore_from_path",
    ),
    *[
        (
            [f"training={train}", f"conversion={convert}", f"export={export}"],
            converted,
            "export.model.nemo_file",
        )
        for train, convert, export in (
            ("t5/220m", "t5/convert_t5", "t5/export_t5"),
            ("mt5/390m", "mt5/convert_mt5", "mt5/export_mt5"),
        )
    ],
    (
        ["fine_tuning=t5/squad", "evaluation=t5/squad"],
        saved_at_train_end("fine_tuning"),
        "evaluation.model.restore_from_path",
    ),
    (
        ["fine_tuning=mt5/xquad", "evaluation=mt5/xquad"],
        saved_at_train_end("fine_tuning"),
        "evaluation.model.restore_from_path",
    ),
    *[
        (
            [f"{group}={tuning}/squad", f"evaluation={evaluation}/squad"],
            lambda cfg, group=group: str(cfg[group].model.nemo_path),
            f"evaluation.model.{key}",
        )
        for group, tuning, evaluation, key in (
            ("prompt_learning", "gpt3", "prompt_gpt3", "virtual_prompt_model_file"),
            ("prompt_learning", "t5", "prompt_t5", "virtual_prompt_model_file"),
            ("adapter_learning", "gpt3", "adapter_gpt3", "adapter_model_file"),
            ("adapter_learning", "t5", "adapter_t5", "adapter_model_file"),
            ("ia3_learning", "gpt3", "ia3_gpt3", "adapter_model_file"),
        )
    ],
    (
        ["peft=gpt3/squad", "evaluation=peft_gpt3/squad"],
        saved_at_train_end("peft"),
        "evaluation.model.peft_model_file",
    ),
    *[
        (
            [f"training={train}", f"conversion={convert}", f"evaluation={evaluation}/squad"],
            converted,
            "evaluation.model.language_model_path",
        )
        for train, convert, evaluations in (
            (
                "gpt3/126m",
                "gpt3/convert_gpt3",
                ("prompt_gpt3", "adapter_gpt3", "ia3_gpt3", "peft_gpt3"),
            ),
            ("t5/220m", "t5/convert_t5", ("prompt_t5", "adapter_t5")),
        )
        for evaluation in evaluations
    ],
]


@pytest.mark.parametrize(
    ("overrides", "written", "read"), CHAINS, ids=[" ".join(chain[0]) for chain in CHAINS]
)
def test_a_stage_reads_what_the_stage_before_it_writes(
    overrides: list[str], written: Callable[[DictConfig], str], read: str
) -> None:
    fills = [fill for o in overrides for fill in FILLS.get(tuple(o.split("=")), [])]
    cfg = composed(*overrides, *fills)
    assert OmegaConf.select(cfg, read) == written(cfg)


def test_peft_evaluation_names_the_peft_runs_scheme() -> None:
    cfg = composed("peft=gpt3/squad", "evaluation=peft_gpt3/squad")
    scheme = cfg.peft.model.peft.peft_scheme
    assert cfg.evaluation.peft_method == {"ptuning": "prompt"}.get(scheme, scheme)
