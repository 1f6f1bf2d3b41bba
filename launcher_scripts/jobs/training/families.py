"""Model families a training recipe names with its top-level `model_family` key.

Each family has its checks (torch-free, run in preflight) and says whether this version's
pretraining program trains it. GPT does. The T5 (and mT5) and BERT recipes keep the NeMo
launcher's layout (T5: `model.encoder` and `model.decoder` blocks, a pipeline split rank; BERT:
GPT's flat keys plus the masked-LM settings); they are checked and rendered, and a dry run
prints their plan, but a real run stops in preflight until their job program exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher_scripts.config.checks import require_choice, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.jobs.training import recipe
from launcher_scripts.jobs.training.optimizer_checks import check_optimizer
from launcher_scripts.jobs.training.recipe import key

# The activations NeMo's encoder models accept (megatron's names).
ENCODER_ACTIVATIONS = (
    "gelu",
    "geglu",
    "reglu",
    "swiglu",
    "relu",
    "squared-relu",
    "fast-geglu",
    "fast-reglu",
    "fast-swiglu",
)
ENCODER_SCHEDULERS = (
    "CosineAnnealing",
    "WarmupAnnealing",
    "constant",
    "InverseSquareRootAnnealing",
)
WORDPIECE_TYPES = ("BertWordPieceCase", "BertWordPieceLowerCase")
# The position embeddings of T5 blocks the reference documents: a learned table, or T5's
# bucketed relative bias.
T5_POSITION_EMBEDDINGS = ("learned_absolute", "relative")
# BERT's, as megatron-core's BertModel takes them.
BERT_POSITION_EMBEDDINGS = ("learned_absolute", "rope")

T5_BLOCKS = ("encoder", "decoder")
Validator = Callable[[Any, str, Callable[[str], bool]], None]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    validate: Validator
    trains: bool  # whether launcher_scripts.jobs.training.pretrain trains it in this version


def family_of(cfg: Any, stage: str) -> ModelFamily:
    name = cfg.get("model_family", "gpt")
    require_choice(key(stage, "model_family"), name, FAMILIES)
    return FAMILIES[name]


def _masked_lm(model: Any, stage: str) -> None:
    probability = model.data.get("masked_lm_prob")
    if not isinstance(probability, float) or not 0 < probability < 1:
        raise ConfigError(
            key(stage, "model.data.masked_lm_prob"),
            f"{probability!r} is not a fraction in (0, 1)",
            "Use e.g. 0.15",
        )


def _encoder_schedule(cfg: Any, stage: str) -> None:
    sched = recipe.section(cfg.model.optim, "sched")
    require_choice(
        key(stage, "model.optim.sched.name"), sched.get("name", "constant"), ENCODER_SCHEDULERS
    )


def _wordpiece_or_sentencepiece(cfg: Any, stage: str) -> None:
    tokenizer = cfg.model.tokenizer
    if tokenizer.get("library") == "megatron":
        require_choice(key(stage, "model.tokenizer.type"), tokenizer.get("type"), WORDPIECE_TYPES)


def _common(cfg: Any, stage: str, will_exist: Callable[[str], bool]) -> None:
    """What every family shares after its layout checks: batch, precision, trainer, inputs."""
    model = cfg.model
    check_optimizer(model, stage)
    par = recipe.parallelism(cfg, stage)
    recipe.check_batch(model, par, stage)
    recipe.precision(cfg, stage)
    recipe.check_trainer(cfg, stage)
    recipe.rendezvous_timeout(cfg, stage)
    _masked_lm(model, stage)
    _encoder_schedule(cfg, stage)
    _wordpiece_or_sentencepiece(cfg, stage)
    recipe.check_inputs(cfg, stage, will_exist)


def validate_bert(cfg: Any, stage: str, will_exist: Callable[[str], bool]) -> None:
    model = cfg.model
    par = recipe.parallelism(cfg, stage)
    recipe.check_world(par, stage)
    recipe.check_layer_split(
        model.num_layers, par.pipeline * (par.virtual_pipeline or 1), par, stage
    )
    recipe.check_attention(model, par, key(stage, "model"))
    seq = recipe.check_sequence(model.data.seq_length, par, stage)
    recipe.check_positions(model, seq, "model.data.seq_length", stage)
    require_choice(
        key(stage, "model.activation"), model.get("activation", "gelu"), ENCODER_ACTIVATIONS
    )
    require_choice(
        key(stage, "model.position_embedding_type"),
        model.get("position_embedding_type", "learned_absolute"),
        BERT_POSITION_EMBEDDINGS,
    )
    recipe.check_recompute(model, stage)
    _common(cfg, stage, will_exist)


def validate_t5(cfg: Any, stage: str, will_exist: Callable[[str], bool]) -> None:
    model = cfg.model
    par = recipe.parallelism(cfg, stage)
    recipe.check_world(par, stage)
    for name, value in (
        ("model.virtual_pipeline_model_parallel_size", par.virtual_pipeline),
        ("model.context_parallel_size", par.context if par.context > 1 else None),
    ):
        if value is not None:
            raise ConfigError(
                key(stage, name), "is not supported for T5 models", "Set it to null (or 1)"
            )
    encoder_stages, decoder_stages = t5_pipeline_split(model, par.pipeline, stage)
    blocks = (("encoder", encoder_stages), ("decoder", decoder_stages))
    for block, stages in blocks:
        prefix = f"model.{block}"
        recipe.check_layer_split(
            model[block].num_layers, stages, par, stage, f"{prefix}.num_layers"
        )
        recipe.check_attention(model[block], par, key(stage, prefix))
        activation = model[block].get("activation", "gelu")
        require_choice(key(stage, f"{prefix}.activation"), activation, ENCODER_ACTIVATIONS)
        recipe.check_recompute(model[block], stage, prefix)
    _t5_positions(model, stage)
    if model.encoder.hidden_size != model.decoder.hidden_size:
        raise ConfigError(
            key(stage, "model.decoder.hidden_size"),
            f"{model.decoder.hidden_size} differs from the encoder's {model.encoder.hidden_size}",
            "Use one hidden size: the decoder attends to the encoder's output",
        )
    seq = recipe.check_sequence(model.data.seq_length, par, stage)
    recipe.check_positions(model, seq, "model.data.seq_length", stage)
    decoder_seq = require_int(key(stage, "model.data.seq_length_dec"), model.data.seq_length_dec)
    recipe.check_positions(model, decoder_seq, "model.data.seq_length_dec", stage)
    sentinels = model.tokenizer.get("num_sentinel_tokens", 0)
    require_int(key(stage, "model.tokenizer.num_sentinel_tokens"), sentinels)
    _common(cfg, stage, will_exist)


def _t5_positions(model: Any, stage: str) -> None:
    """The model's position embeddings (NeMo's top-level model.position_embedding_type) and
    each block's (which follow it unless set): a documented type, and for the relative bias
    whole numbers of buckets and of the largest distance."""
    for prefix, section in (("model", model), *((f"model.{b}", model[b]) for b in T5_BLOCKS)):
        if "position_embedding_type" not in section:
            continue
        kind = section.position_embedding_type
        require_choice(
            key(stage, f"{prefix}.position_embedding_type"), kind, T5_POSITION_EMBEDDINGS
        )
        if kind == "relative":
            for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
                require_int(key(stage, f"{prefix}.{name}"), section.get(name))


def t5_pipeline_split(model: Any, pipeline: int, stage: str) -> tuple[int, int]:
    """(encoder stages, decoder stages): the encoder runs on the pipeline stages before
    `pipeline_model_parallel_split_rank`, the decoder on the rest."""
    if pipeline == 1:
        return 1, 1
    name = key(stage, "model.pipeline_model_parallel_split_rank")
    split = model.get("pipeline_model_parallel_split_rank")
    if isinstance(split, bool) or not isinstance(split, int) or not 0 < split < pipeline:
        raise ConfigError(
            name,
            f"{split!r} must be between 1 and PP - 1 = {pipeline - 1}",
            f"Set it to e.g. {pipeline // 2}: the encoder runs on the stages before it",
        )
    return split, pipeline - split


FAMILIES: dict[str, ModelFamily] = {
    "gpt": ModelFamily("gpt", recipe.validate, trains=True),
    "t5": ModelFamily("t5", validate_t5, trains=False),
    "bert": ModelFamily("bert", validate_bert, trains=False),
}
