"""An imported Hugging Face decoder-only model against transformers, on one process or under
torchrun (one rank per TP x PP rank):

python -m tests.scripts.hf_gpt_check MODEL.nemo HF_DIR EXPORT_DIR TP PP [MODEL HF_DIR ...]

Several models in one launch (five arguments each; TP x PP the processes for each). TP may be
TP:EP for a mixture of experts' experts split over EP ranks (TP x PP x EP processes). For each,
rank 0 prints `report: ` and JSON: `logits` the largest difference of every row's logits (the
checkpoint's rows, its rows past the tokenizer's included; not those an import padded for TP)
over a batch of token ids; `greedy` both sides' greedy tokens for the same prompts;
`token_ids` whether our tokenizer encodes the corpus as transformers' does (no special tokens
added); `keys_equal`/`tensors_equal` whether the portable file written back as a Hugging Face
directory (EXPORT_DIR; `-`: not written, and these left out) holds exactly the original
tensors; `class` the class transformers loads it as.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

PROMPTS = ["the river runs north", "in the morning the village was quiet", "who founded the"]
TOKENS = 10


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 5 == 0, __doc__
    cases = [args[at : at + 5] for at in range(0, len(args), 5)]
    # Every rank computes ours for every case first, in step; then rank 0 alone asks
    # transformers (a rank still busy there would keep the others from their next group).
    from launcher_scripts.jobs.inference.runner import close_runner

    computed = [ours_of(Path(case[0]), *parallel_sizes(case[3]), int(case[4])) for case in cases]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    close_runner()
    if rank != 0:
        return
    for (model_file, hf_dir, export_dir, *_), ours in zip(cases, computed, strict=True):
        report = against_transformers(ours, Path(hf_dir))
        if export_dir != "-":
            report |= exported_back(Path(model_file), Path(hf_dir), Path(export_dir))
        print(f"report: {json.dumps(report)}", flush=True)


def parallel_sizes(value: str) -> tuple[int, int]:
    """TP, or TP:EP, as (TP, EP)."""
    tensor, _, expert = value.partition(":")
    return int(tensor), int(expert or 1)


def ours_of(model_file: Path, tensor: int, expert: int, pipeline: int) -> dict[str, Any]:
    from megatron.core import parallel_state

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import open_runner
    from tests.scripts.make_hf_gpt import corpus

    runner = open_runner(model_file, tensor, pipeline, on_gpu=False, expert=expert)
    every_row = dataclasses.replace(runner, vocab_size=int(runner.chunks[0].vocab_size))
    # Ids of the checkpoint's rows (not of those the import padded, which transformers lacks).
    checkpoint_rows = portable.read_config(model_file).get("hf_vocab_size", every_row.vocab_size)
    batch = torch.randint(0, checkpoint_rows, (3, 20), generator=torch.Generator().manual_seed(1))
    logits = every_row.logits(batch.tolist())
    prompts = [runner.tokenizer.encode(text) for text in PROMPTS]
    params = GenerationParams(tokens_to_generate=TOKENS, top_k=1)
    completions = generate(runner, runner.tokenizer, PROMPTS, params, max_length=runner.max_length)
    texts = corpus(60)
    ours = {
        "batch": batch,
        "logits": logits,
        "prompts": prompts,
        "greedy": [c.tokens for c in completions],
        "texts": texts,
        "ids": [runner.tokenizer.encode(text) for text in texts],
        "eod": runner.tokenizer.eod_id,
        "rows": (runner.vocab_size, every_row.vocab_size),
    }
    # The next case's groups, in the same processes (the processes' own group stays).
    parallel_state.destroy_model_parallel()
    return ours


def against_transformers(ours: dict[str, Any], hf_dir: Path) -> dict[str, Any]:
    import transformers

    batch, prompts, eod = ours["batch"], ours["prompts"], ours["eod"]
    tokenizer_rows, model_rows = ours["rows"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    # The checkpoint's rows; ours has the import's padding past them (rows TP needs).
    model_rows = min(model_rows, int(theirs.config.vocab_size))
    with torch.no_grad():
        reference = theirs(input_ids=batch).logits
        theirs_greedy = []
        for prompt in prompts:
            out = theirs.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=TOKENS,
                do_sample=False,
                num_beams=1,
                eos_token_id=eod,
                pad_token_id=eod,
                # Ours chooses among the tokenizer's ids, not the checkpoint's padding rows.
                suppress_tokens=list(range(tokenizer_rows, model_rows)),
            )
            answer = out[0, len(prompt) :].tolist()
            theirs_greedy.append(answer[: answer.index(eod)] if eod in answer else answer)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    theirs_ids = [tokenizer(text, add_special_tokens=False).input_ids for text in ours["texts"]]

    return {
        "logits": float((ours["logits"][..., :model_rows] - reference).abs().max()),
        "greedy": [ours["greedy"], theirs_greedy],
        "token_ids": ours["ids"] == theirs_ids,
    }


def exported_back(model_file: Path, hf_dir: Path, export_dir: Path) -> dict[str, Any]:
    """The portable file written back as a Hugging Face directory, against the original."""
    import transformers
    from safetensors.torch import load_file

    from tests.scripts.hf_export import export

    export(model_file, export_dir)
    original = load_file(hf_dir / "model.safetensors")
    back = load_file(export_dir / "model.safetensors")
    again = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    return {
        "keys_equal": sorted(original) == sorted(back),
        "missing": sorted(set(original) - set(back)),
        "tensors_equal": all(torch.equal(original[k], back[k]) for k in original if k in back),
        "class": type(again).__name__,
    }


if __name__ == "__main__":
    main()
