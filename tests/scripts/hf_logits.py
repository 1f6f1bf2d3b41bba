"""Logits of a Hugging Face export, computed by transformers in a fresh process:

python -m tests.scripts.hf_logits HF_DIR INPUTS.pt OUT.pt [HF_DIR INPUTS OUT ...]

INPUTS.pt and OUT.pt as tests/scripts/portable_logits.py's, several directories in one process
as there. Prints the model class transformers chose, a line per directory. A fresh interpreter
keeps the comparison free of whatever earlier tests left in the pytest process (threads,
default dtype, global flags).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, __doc__
    for at in range(0, len(args), 3):
        compute(*(Path(a) for a in args[at : at + 3]))


def compute(hf_dir: Path, inputs_file: Path, output: Path) -> None:
    import transformers

    inputs = torch.load(inputs_file)
    if "tokens" in inputs:
        auto, arguments = transformers.AutoModelForCausalLM, {"input_ids": inputs["tokens"]}
    elif "text_enc" in inputs:
        enc, dec = inputs["text_enc"], inputs["text_dec"]
        auto = transformers.AutoModelForSeq2SeqLM
        arguments = {
            "input_ids": enc,
            "attention_mask": inputs.get("enc_mask", enc != 0).long(),
            "decoder_input_ids": dec,
            "decoder_attention_mask": inputs.get("dec_mask", dec != 0).long(),
        }
    else:
        auto = transformers.AutoModelForPreTraining
        arguments = {
            "input_ids": inputs["text"],
            "attention_mask": inputs["padding_mask"],
            "token_type_ids": inputs["types"],
        }
    model = auto.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        result = model(**arguments)
    logits = getattr(result, "logits", None)
    if logits is None:  # BERT's pre-training heads
        logits = result.prediction_logits
    saved = {"logits": logits}
    if getattr(result, "seq_relationship_logits", None) is not None:
        saved["order"] = result.seq_relationship_logits
    torch.save(saved, output)
    print(type(model).__name__)


if __name__ == "__main__":
    main()
