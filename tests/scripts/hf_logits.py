"""Logits of a Hugging Face export, computed by transformers in a fresh process:

python -m tests.scripts.hf_logits HF_DIR TOKENS.pt OUT.pt

Prints the model class transformers chose. A fresh interpreter keeps the comparison with
tests/scripts/portable_logits.py free of whatever earlier tests left in the pytest process
(threads, default dtype, global flags).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM

    hf_dir, tokens_file, output = (Path(a) for a in sys.argv[1:4])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.save(model(torch.load(tokens_file)).logits, output)
    print(type(model).__name__)


if __name__ == "__main__":
    main()
