"""T5 and mT5: an encoder-decoder trained on span corruption (megatron-core's T5Model). Their
recipes keep the NeMo launcher's layout: `model.encoder` and `model.decoder` blocks and a
pipeline split rank. mT5 is T5 with a SentencePiece tokenizer and multilingual data."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from launcher_scripts.config.checks import require_choice, require_int, require_position_embedding
from launcher_scripts.costmodel.plan import encoder_decoder_costs, encoder_decoder_shape
from launcher_scripts.errors import ConfigError
from launcher_scripts.families import t5_hf_config
from launcher_scripts.families.base import Architecture, ModelFamily, register
from launcher_scripts.families.encoder_checks import ENCODER_ACTIVATIONS, common_checks
from launcher_scripts.formats.portable_check import expected_shapes
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.layout import check_experts, check_world, read_layout
from launcher_scripts.recipes.model_shape import read_experts
from launcher_scripts.recipes.training import encoder_decoder_split, key
from launcher_scripts.recipes.tuning import SFT_STAGES

# The position embeddings the reference documents for T5 blocks: a learned table, or T5's
# bucketed relative bias.
POSITION_EMBEDDINGS = ("learned_absolute", "relative")
SPAN_CORRUPTION = "t5"  # NeMo's data.dataset_type of the span-corruption objective
BLOCKS = ("encoder", "decoder")
# megatron-core's T5 layers normalise before attention and MLP.
BLOCK_TYPES = ("pre_ln",)
# tokenizer.type of a Hugging Face T5 tokenizer (tokenizer.model: its tokenizer.json or
# spiece.model), whose ids an imported model has
HF_T5_TOKENIZER = "hf_t5"


def validate(cfg: Any, stage: str, will_exist: Callable[[str], bool]) -> None:
    model = cfg.model
    layout = read_layout(cfg, stage)
    check_world(layout, stage)
    for name, value in (
        ("model.virtual_pipeline_model_parallel_size", layout.virtual_pipeline),
        ("model.context_parallel_size", layout.context if layout.context > 1 else None),
    ):
        if value is not None:
            raise ConfigError(
                key(stage, name), "is not supported for T5 models", "Set it to null (or 1)"
            )
    encoder_stages, decoder_stages = encoder_decoder_split(model, layout.pipeline, stage)
    blocks = (("encoder", encoder_stages), ("decoder", decoder_stages))
    for block, stages in blocks:
        prefix = f"model.{block}"
        recipe.check_layer_split(
            model[block].num_layers, stages, layout, stage, f"{prefix}.num_layers"
        )
        recipe.check_attention(model[block], layout, key(stage, prefix))
        activation = model[block].get("activation", "gelu")
        require_choice(key(stage, f"{prefix}.activation"), activation, ENCODER_ACTIVATIONS)
        recipe.check_recompute(model[block], stage, prefix)
        block_type = model[block].get("transformer_block_type", "pre_ln")
        require_choice(key(stage, f"{prefix}.transformer_block_type"), block_type, BLOCK_TYPES)
        _check_experts(model[block], layout, stage, prefix)
    _positions(model, stage)
    if model.encoder.hidden_size != model.decoder.hidden_size:
        raise ConfigError(
            key(stage, "model.decoder.hidden_size"),
            f"{model.decoder.hidden_size} differs from the encoder's {model.encoder.hidden_size}",
            "Use one hidden size: the decoder attends to the encoder's output",
        )
    seq = recipe.check_sequence(model.data.seq_length, layout, stage)
    recipe.check_positions(model, seq, "model.data.seq_length", stage)
    decoder_seq = require_int(key(stage, "model.data.seq_length_dec"), model.data.seq_length_dec)
    recipe.check_positions(model, decoder_seq, "model.data.seq_length_dec", stage)
    sentinels = model.tokenizer.get("num_sentinel_tokens", 0)
    require_int(key(stage, "model.tokenizer.num_sentinel_tokens"), sentinels)
    common_checks(cfg, stage, will_exist)
    _span_corruption_room(model, seq, decoder_seq, int(sentinels), stage)


# The model-level position settings megatron-core's T5Model takes once for both blocks, and
# the values the job builds it with when the recipe leaves them out (jobs/models/t5.py).
SHARED_POSITION_KEYS = {
    "position_embedding_type": "learned_absolute",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
}


def _positions(model: Any, stage: str) -> None:
    """The model's position embeddings (NeMo's top-level model.position_embedding_type): a
    documented type, and for the relative bias whole numbers of buckets and of the largest
    distance. megatron-core's T5Model takes one setting for both blocks, so a block's own
    value (NeMo's recipes repeat them per block) must be the model's: a different one would be
    ignored by the job yet recorded in the model's config."""
    for prefix, section in (("model", model), *((f"model.{b}", model[b]) for b in BLOCKS)):
        if "position_embedding_type" not in section:
            continue
        kind = section.position_embedding_type
        require_position_embedding(
            key(stage, f"{prefix}.position_embedding_type"), kind, POSITION_EMBEDDINGS
        )
        if kind == "relative":
            for name in ("relative_attention_num_buckets", "relative_attention_max_distance"):
                require_int(key(stage, f"{prefix}.{name}"), section.get(name))
    for name, default in SHARED_POSITION_KEYS.items():
        used = model.get(name, default)
        for block in BLOCKS:
            if name in model[block] and model[block][name] != used:
                raise ConfigError(
                    key(stage, f"model.{block}.{name}"),
                    f"{model[block][name]!r} differs from model.{name} {used!r}, which "
                    "megatron-core's T5 uses for both blocks",
                    f"Set model.{name} (the blocks follow it: ${{..{name}}}) and leave "
                    f"model.{block}.{name} equal to it",
                )


def _span_corruption_room(
    model: Any, seq: int, decoder_seq: int, sentinels: int, stage: str
) -> None:
    """Room for what megatron-core's T5MaskedWordPieceDataset writes for a sample: it takes up
    to seq_length - 2 tokens and masks at most masked_lm_prob of them, each masked span
    replaced by the next sentinel (an IndexError when they run out); the decoder reads a start
    token, and a sentinel then the tokens for each span (an AssertionError when it is longer
    than seq_length_dec). An imported Hugging Face T5 tokenizer brings its own sentinels and
    is not pretrained on span corruption (the job says so)."""
    objective = model.data.get("dataset_type", SPAN_CORRUPTION)
    if objective != SPAN_CORRUPTION:
        raise ConfigError(
            key(stage, "model.data.dataset_type"),
            f"{objective!r}: T5 and mT5 train on span corruption here (megatron-core's T5 "
            "dataset); NeMo's ul2 and t5_prefix_lm objectives are not implemented",
            f"Set it to {SPAN_CORRUPTION}",
        )
    if model.tokenizer.get("type") == HF_T5_TOKENIZER:
        return
    masked = masked_tokens_at_most(float(model.data.masked_lm_prob), seq)
    max_ngram = require_int(
        key(stage, "model.data.max_ngram_size"), model.data.get("max_ngram_size", 10), minimum=1
    )
    if sentinels < masked:
        raise ConfigError(
            key(stage, "model.tokenizer.num_sentinel_tokens"),
            f"{sentinels} is fewer than the {masked} masked spans a sample of seq_length {seq} "
            f"can hold (masked_lm_prob x (seq_length - 2), each span possibly one token)",
            f"Set it to at least {masked}",
        )
    # A full sample masks that many tokens, in spans of at most max_ngram_size tokens (words,
    # with whole-word masking: of any number of tokens).
    longest_span = 0 if model.data.get("whole_word_masking", True) else max_ngram
    spans = math.ceil(masked / longest_span) if longest_span else min(masked, 1)
    least = 1 + masked + spans
    if decoder_seq < least:
        raise ConfigError(
            key(stage, "model.data.seq_length_dec"),
            f"{decoder_seq} is shorter than the decoder input of a sample of seq_length {seq}: "
            f"a start token, {masked} masked tokens and a sentinel for each of at least "
            f"{spans} span(s)",
            f"Set it to at least {least} ({1 + 2 * masked} holds even a sample whose spans "
            "are all one token long)",
        )


def masked_tokens_at_most(probability: float, seq: int) -> int:
    """The most tokens megatron-core's T5 masking replaces in a sample: its count is at most
    masked_lm_prob x the sample's target length (seq_length - 2: room for <bos> and <eos>)."""
    return math.floor(probability * (seq - 2))


def _check_experts(block: Any, layout: Any, stage: str, prefix: str) -> None:
    """A block's Switch-style experts (the NeMo launcher's T5 mixture of experts: no expert
    parallelism). megatron-core trains MoE layers under TP only with sequence parallelism,
    which its T5 has not: TP 1."""
    where = key(stage, prefix)
    experts = read_experts(block, where, int(block.num_layers), int(block.ffn_hidden_size))
    if experts is not None and layout.tensor > 1:
        raise ConfigError(
            key(stage, "model.tensor_model_parallel_size"),
            f"is {layout.tensor}, but {where} has experts, which megatron-core trains under TP "
            "only with sequence parallelism, and its T5 has none",
            "Set tensor_model_parallel_size=1 (split the model over PP, or the batch over DP)",
        )
    check_experts(experts, layout, stage, bool(block.get("bias", True)), prefix)


def check_base(base: Any, model: Any, layout: Any, stage: str, name: str) -> None:
    """The tuning layout splits each block's heads over TP, and the encoder over the stages
    before the recipe's split rank (the decoder runs on the last)."""
    encoder_stages, _ = encoder_decoder_split(model, layout.pipeline, stage)
    for block in BLOCKS:
        recipe.check_attention(base[block], layout, f"{name} {block}")
    layers = int(base.encoder.num_layers)
    if layers % encoder_stages:
        raise ConfigError(
            f"{stage}.model.pipeline_model_parallel_size",
            f"the base model's {layers} encoder layers do not split over {encoder_stages} "
            f"encoder stages (PP - 1)",
            "Choose a PP with PP - 1 dividing them",
        )


def portable_shapes(config: Any) -> dict[str, tuple[tuple[int | None, ...], str]]:
    """Each block's tensors as GPT's table gives a stack's (the block's keys over the model's),
    and the decoder's cross-attention."""
    shared = {k: v for k, v in config.items() if k not in BLOCKS}
    shapes = {}
    for block in BLOCKS:
        merged = {**shared, **config[block]}
        for name, (shape, keys) in expected_shapes(merged).items():
            shapes[name.replace("decoder.layers.", f"{block}.layers.", 1)] = (
                shape,
                f"{block}: {keys}" if name.startswith("decoder.layers.") else keys,
            )
    decoder = config.decoder
    layers, hidden = int(decoder.num_layers), int(decoder.hidden_size)
    heads = int(decoder.num_attention_heads)
    groups = int(decoder.get("num_query_groups") or heads)
    channels = int(decoder.get("kv_channels") or hidden // heads)
    keys = "decoder: num_layers, num_attention_heads, kv_channels, hidden_size"
    cross = "decoder.layers.cross_attention."
    shapes[f"{cross}linear_q.weight"] = ((layers, heads * channels, hidden), keys)
    shapes[f"{cross}linear_kv.weight"] = ((layers, 2 * groups * channels, hidden), keys)
    shapes[f"{cross}linear_proj.weight"] = ((layers, hidden, heads * channels), keys)
    return shapes


T5_CLASS = Architecture("T5ForConditionalGeneration", "t5")
MT5_CLASS = Architecture("MT5ForConditionalGeneration", "mt5")
# Our activation -> Hugging Face T5's feed_forward_proj computing it exactly ("gated-gelu" is
# the tanh GeLU there; gelu_python is the exact one).
HF_FEED_FORWARD = {
    "gelu": "gelu",
    "relu": "relu",
    "geglu": "gated-gelu_python",
    "fast-geglu": "gated-gelu_python",
    "reglu": "gated-relu",
    "fast-reglu": "gated-relu",
    "swiglu": "gated-silu",
    "fast-swiglu": "gated-silu",
    "geglu-tanh": "gated-gelu",
}
# What Hugging Face's T5 config holds once for both blocks.
SHARED_BLOCK_KEYS = (
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "kv_channels",
    "layernorm_epsilon",
    "activation",
)


def hf_architecture(model: Any, key_prefix: str = "model") -> Architecture:
    """T5 v1.1's layout (mT5's too) is what Hugging Face's T5 classes compute: relative
    position buckets, RMSNorm, no linear biases, an output layer of its own, one width for both
    blocks. A SentencePiece model is mT5's tokenizer: MT5ForConditionalGeneration."""

    def refuse(name: str, problem: str) -> ConfigError:
        return ConfigError(
            f"{key_prefix}.{name}",
            f"{problem}: Hugging Face's T5 classes compute T5 v1.1's layout only",
            "Train with relative positions, rmsnorm, bias=False and "
            "share_decoder_tokens_head_embeddings=False (t5/tiny does), or set "
            "conversion.run.hf_dir_name=null",
        )

    # megatron-core's output layer on the embedding table has a bias, which an imported model
    # holds at zero (the export checks it still is); a trained one's is not.
    imported = model.get("hf_architecture") is not None
    if model.get("share_decoder_tokens_head_embeddings", True) and not imported:
        raise refuse("share_decoder_tokens_head_embeddings", "an output layer with a bias")
    scale = model.get("decoder_output_scale")
    if scale is not None and scale != int(model.encoder.hidden_size) ** -0.5:
        raise refuse("decoder_output_scale", f"{scale} (not d_model^-0.5)")
    for prefix, section in (("", model), *((f"{b}.", model[b]) for b in BLOCKS)):
        positions = section.get("position_embedding_type", "learned_absolute")
        if positions != "relative":
            raise refuse(f"{prefix}position_embedding_type", f"{positions!r}")
    for block in BLOCKS:
        section = model[block]
        checks = (
            ("normalization", "layernorm", "rmsnorm"),
            ("bias", True, False),
            ("relative_position_bias_self_attention_only", True, True),
        )
        for name, default, allowed in checks:
            value = section.get(name, default)
            if value != allowed:
                raise refuse(f"{block}.{name}", f"{value!r}")
        activation = section.get("activation", "gelu")
        if activation not in HF_FEED_FORWARD:
            raise refuse(f"{block}.activation", f"{activation!r}")
        heads = int(section.num_attention_heads)
        if int(section.get("num_query_groups") or heads) != heads:
            raise refuse(f"{block}.num_query_groups", "grouped-query attention")
    for name in SHARED_BLOCK_KEYS:
        encoder, decoder = model.encoder.get(name), model.decoder.get(name)
        if encoder != decoder:
            raise refuse(f"decoder.{name}", f"{decoder!r} differs from the encoder's {encoder!r}")
    recorded = model.get("hf_architecture")  # an imported model's own class
    for known in (T5_CLASS, MT5_CLASS):
        if recorded == known.name:
            return known
    return MT5_CLASS if model.tokenizer.get("library") == "sentencepiece" else T5_CLASS


T5 = register(
    ModelFamily(
        name="t5",
        model_types=("t5", "mt5"),
        validate=validate,
        shape=encoder_decoder_shape,
        costs=encoder_decoder_costs,
        encoder_decoder=True,
        pile_tokenizers=("BertWordPieceCase", "BertWordPieceLowerCase"),
        programs=frozenset(
            {
                "training",
                "conversion",
                *SFT_STAGES,
                "evaluation:fine_tuned",
                "export",
                "hf_import",
            }
        ),
        hf_architecture=hf_architecture,
        sentence_data=True,
        runtime="launcher_scripts.jobs.models.t5",
        check_base=check_base,
        portable_shapes=portable_shapes,
        hf_model_types=("t5", "mt5"),
        hf_import_check=t5_hf_config.check_checkpoint,
        hf_importer="launcher_scripts.jobs.models.t5_hf",
    )
)
