"""A Hugging Face T5 or mT5 checkpoint against its config.json, torch-free: the conversion
stage's preflight asks it (ModelFamily.hf_import_check) before anything is submitted, and the
import job (jobs/models/t5_hf.py) again. A tensor or a tokenizer that disagrees with the
config is refused in one line naming the field, the tensor and both values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher_scripts.errors import HfImportError
from launcher_scripts.families.hf_checkpoint import (
    Dimension,
    check_dimensions,
    check_layer_count,
    check_output_layer,
    check_tokenizer,
    reading_tokenizer,
)
from launcher_scripts.formats.safetensors_stream import TensorSource

SENTINEL = "<extra_id_{}>"  # T5's names of the masked spans' stand-ins
TOKENIZER_FILES = ("tokenizer.json", "spiece.model")  # the first there is the model's
EMBEDDING = "shared.weight"


def tokenizer_file(directory: Path) -> Path:
    """The directory's tokenizer: tokenizer.json, else spiece.model."""
    found = next((directory / n for n in TOKENIZER_FILES if (directory / n).is_file()), None)
    if found is None:
        raise HfImportError(
            f"{directory} has neither tokenizer.json nor spiece.model: save the model's "
            "tokenizer there (tokenizer.save_pretrained)"
        )
    return found


def hf_t5_tokens(model_file: Path) -> list[str]:
    """Every token of a Hugging Face T5 tokenizer, in id order (an id nothing names: "");
    HfImportError naming the file when it is not a tokenizer."""
    with reading_tokenizer(model_file):
        if model_file.suffix == ".json":
            from tokenizers import Tokenizer

            table = Tokenizer.from_file(str(model_file)).get_vocab(with_added_tokens=True)
            names = [""] * (max(table.values(), default=-1) + 1)
            for name, index in table.items():
                names[index] = name
            return names
        import sentencepiece  # spiece.model: the pieces, then T5Tokenizer's 100 sentinels

        processor = sentencepiece.SentencePieceProcessor()
        processor.Load(str(model_file))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    pieces[0], pieces[processor.eos_id()] = "<pad>", "</s>"
    return pieces + [SENTINEL.format(i) for i in reversed(range(100))]


def _dimensions(config: dict[str, Any], layers: dict[str, int]) -> list[Dimension]:
    hidden, ffn = int(config["d_model"]), int(config["d_ff"])
    heads = int(config["num_heads"])
    # (the field, its value): the size two fields make together
    attention = ("num_heads x d_kv", heads * int(config["d_kv"]))
    buckets = int(config["relative_attention_num_buckets"])
    vocab = int(config["vocab_size"])
    dims = [
        Dimension("vocab_size", vocab, EMBEDDING, 0),
        Dimension("vocab_size", vocab, "lm_head.weight", 0),
        Dimension("d_model", hidden, EMBEDDING, 1),
        Dimension("d_model", hidden, "lm_head.weight", 1),
    ]
    for stack, count in layers.items():
        dims.append(Dimension("d_model", hidden, f"{stack}.final_layer_norm.weight", 0))
        table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        dims += [
            Dimension("relative_attention_num_buckets", buckets, table, 0),
            Dimension("num_heads", heads, table, 1),
        ]
        attentions = ["0.SelfAttention"] + (["1.EncDecAttention"] if stack == "decoder" else [])
        feed = 2 if stack == "decoder" else 1
        for i in range(count):
            block = f"{stack}.block.{i}.layer."
            for part in attentions:
                for name in "qkv":
                    dims += [
                        Dimension(*attention, f"{block}{part}.{name}.weight", 0),
                        Dimension("d_model", hidden, f"{block}{part}.{name}.weight", 1),
                    ]
                dims += [
                    Dimension("d_model", hidden, f"{block}{part}.o.weight", 0),
                    Dimension(*attention, f"{block}{part}.o.weight", 1),
                ]
            for name in ("wi", "wi_0", "wi_1"):
                weight = f"{block}{feed}.DenseReluDense.{name}.weight"
                dims += [Dimension("d_ff", ffn, weight, 0), Dimension("d_model", hidden, weight, 1)]
            wo = f"{block}{feed}.DenseReluDense.wo.weight"
            dims += [Dimension("d_model", hidden, wo, 0), Dimension("d_ff", ffn, wo, 1)]
    return dims


def check_checkpoint(directory: Path, config: dict[str, Any]) -> None:
    """The checkpoint's tensors and tokenizer agree with its config.json (ModelFamily
    .hf_import_check): HfImportError naming the field, the tensor and both values."""
    try:
        layers = {"encoder": int(config["num_layers"])}
        layers["decoder"] = int(config.get("num_decoder_layers") or layers["encoder"])
        dimensions = _dimensions(config, layers)
    except KeyError as missing:
        raise HfImportError(f"config.json has no {missing.args[0]}") from None
    except (TypeError, ValueError) as error:
        raise HfImportError(f"config.json: a size is not a number ({error})") from None
    source = TensorSource(directory)
    if EMBEDDING not in source:
        raise HfImportError(f"{directory}: the checkpoint has no tensor {EMBEDDING}")
    check_dimensions(source, dimensions)
    check_layer_count(source, "encoder.block.", "num_layers", layers["encoder"])
    check_layer_count(source, "decoder.block.", "num_decoder_layers", layers["decoder"])
    check_output_layer(config, source, "lm_head.weight")
    path = tokenizer_file(directory)
    check_tokenizer(path, len(hf_t5_tokens(path)), source, EMBEDDING)
