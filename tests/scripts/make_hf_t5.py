"""Tiny random-initialised Hugging Face T5 models, built and saved by transformers itself (no
hub), with a SentencePiece tokenizer trained on the shipped corpus:

python -m tests.scripts.make_hf_t5 OUT_DIR

writes OUT_DIR/{t5_v1,t5_v1.1,mt5}: T5 v1.0 (ReLU, one table for the embedding and the output
layer, the decoder's output scaled), T5 v1.1 (tanh GeGLU, an output layer of its own) and mT5
(MT5ForConditionalGeneration, tanh GeGLU). The decoder has a layer more than the encoder, and
the norms are not all ones, so that a swapped tensor shows.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import sentencepiece
import torch
from transformers import (
    MT5Config,
    MT5ForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    T5Tokenizer,
)

from tests.support import REPO

VARIANTS = {
    # name: (config class, model class, feed_forward_proj, one table and a scaled output)
    "t5_v1": (T5Config, T5ForConditionalGeneration, "relu", True),
    "t5_v1.1": (T5Config, T5ForConditionalGeneration, "gated-gelu", False),
    "mt5": (MT5Config, MT5ForConditionalGeneration, "gated-gelu", False),
}


def tokenizer(folder: Path) -> T5Tokenizer:
    corpus = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    with gzip.open(corpus, "rt") as lines:
        texts = [json.loads(line)["text"] for _, line in zip(range(400), lines, strict=False)]
    (folder / "corpus.txt").write_text("\n".join(texts))
    sentencepiece.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "spiece"), vocab_size=500,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2,
    )  # fmt: skip
    return T5Tokenizer.from_pretrained(folder, extra_ids=10)  # T5's ids: sentinels at the end


def main() -> None:
    out = Path(sys.argv[1])
    (out / "sentencepiece").mkdir(parents=True)
    tok = tokenizer(out / "sentencepiece")
    for name, (config_class, model_class, feed_forward, v1) in VARIANTS.items():
        config = config_class(
            vocab_size=512, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3,
            num_heads=4, feed_forward_proj=feed_forward, tie_word_embeddings=v1,
            decoder_start_token_id=0, dropout_rate=0.0,
        )  # fmt: skip
        torch.manual_seed(0)
        model = model_class(config).eval()
        if not v1:  # an output layer of its own, as T5 v1.1's and mT5's checkpoints have
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "layer_norm" in parameter_name:
                    parameter.copy_(1 + 0.1 * torch.randn_like(parameter))
            # The padding's output row at zero, as training leaves it: greedy answers are words.
            model.shared.weight[0].zero_()
            model.lm_head.weight[0].zero_()
        model.save_pretrained(out / name)
        tok.save_pretrained(out / name)
        print(out / name)


if __name__ == "__main__":
    main()
