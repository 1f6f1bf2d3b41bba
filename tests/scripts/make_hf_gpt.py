"""Tiny random-initialised Hugging Face decoder-only models, built and saved by transformers
itself (no hub), with tokenizers trained on the shipped corpus:

python -m tests.scripts.make_hf_gpt OUT_DIR [VARIANT ...]

writes OUT_DIR/<variant> for each of VARIANTS (or those named): Llama 3 style (GQA, its own
output layer, rope_theta and Llama 3's rope scaling), Llama with one table for the embedding
and the output layer and a head size of its own, Mistral (its tokenizer a SentencePiece
tokenizer.model), Qwen2 (biases on Q, K and V), StableLM (LayerNorm, a quarter of each head
rotated, Q/K/V biases) and GPT-2 (tanh GeLU, learned positions; also with 1001 rows, which no
TP above 1 divides). The norms and biases are not zeros and ones, so that a swapped or dropped
tensor shows.
"""

from __future__ import annotations

import functools
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.support import REPO

COMMON = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4}
ROTARY = {**COMMON, "num_attention_heads": 4, "max_position_embeddings": 256, "hidden_act": "silu"}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "Llama",
        {
            **ROTARY,
            "num_key_value_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
        },
    ),  # fmt: skip
    "llama_tied": (
        "Llama",
        {**ROTARY, "num_key_value_heads": 4, "head_dim": 24, "tie_word_embeddings": True},
    ),
    "mistral": ("Mistral", {**ROTARY, "num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": (
        "Qwen2",
        {**ROTARY, "num_key_value_heads": 2, "rope_theta": 1e6, "tie_word_embeddings": True},
    ),
    "stablelm": (
        "StableLm",
        {
            **ROTARY,
            "num_key_value_heads": 4,
            "partial_rotary_factor": 0.25,
            "use_qkv_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    "gpt2": (
        "GPT2",
        {
            "vocab_size": 512,
            "n_embd": 64,
            "n_layer": 4,
            "n_head": 4,
            "n_positions": 256,
            "activation_function": "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),  # fmt: skip
}
# Mixture-of-experts models: Mixtral (4 experts, top 2, renormalised), Qwen2-MoE (fine
# experts, top 2 of 6 not renormalised, a gated shared expert, QKV biases) and Qwen3-MoE (a
# head size of its own, norms over each head's queries and keys).
VARIANTS["mixtral"] = (
    "Mixtral",
    {
        **ROTARY,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "sliding_window": None,
    },
)
VARIANTS["qwen2_moe"] = (
    "Qwen2Moe",
    {
        **ROTARY,
        "num_key_value_heads": 2,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 80,
        "norm_topk_prob": False,
        "tie_word_embeddings": False,
    },
)
VARIANTS["qwen3_moe"] = (
    "Qwen3Moe",
    {
        **ROTARY,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 40,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
)
# GPT-2 with a vocabulary no TP above 1 divides: the import pads its rows.
VARIANTS["gpt2_odd"] = ("GPT2", {**VARIANTS["gpt2"][1], "vocab_size": 1001})
EOS = "<|endoftext|>"


def corpus(limit: int = 400) -> list[str]:
    path = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        return [json.loads(line)["text"] for _, line in zip(range(limit), lines, strict=False)]


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's, Llama 3's and Qwen2's kind) with its end-of-text token: a
    fresh copy of the one trained for this size."""
    return Tokenizer.from_str(_trained_byte_level(vocab_size))


@functools.cache
def _trained_byte_level(vocab_size: int) -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 12,  # room for the model's rows past the tokenizer's
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    return tokenizer.to_str()


def sentencepiece_tokenizer(folder: Path, vocab_size: int) -> Path:
    import sentencepiece

    (folder / "corpus.txt").write_text("\n".join(corpus()))
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"),
        vocab_size=vocab_size - 12, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )  # fmt: skip
    return folder / "tokenizer.model"


def save_tokenizer(name: str, folder: Path, scratch: Path) -> None:
    if name == "mistral":  # a SentencePiece model only, as older Llama and Mistral ship
        model = sentencepiece_tokenizer(scratch, 512)
        (folder / "tokenizer.model").write_bytes(model.read_bytes())
        settings = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}
        settings |= {"add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>"}
        settings |= {"unk_token": "<unk>", "legacy": True}
        (folder / "tokenizer_config.json").write_text(json.dumps(settings))
        return
    trained = byte_level_tokenizer(512)
    if name == "qwen2":
        # Qwen2's own class (its pre-tokenizer splits digits), which transformers loads for a
        # Qwen2 directory whatever tokenizer.json says: over the trained vocabulary and merges.
        trained.model.save(str(scratch))
        vocab = json.loads((scratch / "vocab.json").read_text())
        lines = (scratch / "merges.txt").read_text().splitlines()[1:]
        merges = [tuple(line.split(" ")) for line in lines if line]
        fast = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    else:
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=trained, eos_token=EOS, bos_token=EOS
        )
    if name.startswith("gpt2"):
        fast = transformers.GPT2TokenizerFast(tokenizer_object=fast.backend_tokenizer)
    fast.save_pretrained(folder)


def build(name: str, family: str, settings: dict[str, Any]) -> torch.nn.Module:
    config = getattr(transformers, f"{family}Config")(**settings)
    torch.manual_seed(len(name))
    model = getattr(transformers, f"{family}ForCausalLM" if family != "GPT2" else "GPT2LMHeadModel")
    built = model(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in built.named_parameters():
            if "norm" in parameter_name or "ln_" in parameter_name:
                parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            elif parameter_name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn_like(parameter))
    return built


def main() -> None:
    out = Path(sys.argv[1])
    scratch = out / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    chosen = sys.argv[2:] or list(VARIANTS)
    for name in chosen:
        family, settings = VARIANTS[name]
        folder = out / name
        build(name, family, settings).save_pretrained(folder)
        save_tokenizer(name, folder, scratch)
        print(folder)


if __name__ == "__main__":
    main()
