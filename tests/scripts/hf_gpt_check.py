"""An imported Hugging Face decoder-only model against transformers, on one process or under
torchrun (one rank per TP x PP rank):

python -m tests.scripts.hf_gpt_check MODEL.nemo HF_DIR EXPORT_DIR TP PP

Rank 0 prints JSON: `logits` the largest difference of every row's logits (the checkpoint's
rows, padding rows included) over a batch of token ids; `greedy` both sides' greedy tokens for
the same prompts; `token_ids` whether our tokenizer encodes the corpus as transformers' does
(no special tokens added); `keys_equal`/`tensors_equal` whether the portable file written back
as a Hugging Face directory (EXPORT_DIR) holds exactly the original tensors; `class` the class
transformers loads it as.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = ["the river runs north", "in the morning the village was quiet", "who founded the"]
TOKENS = 10


def main() -> None:
    model_file, hf_dir, export_dir = (Path(a) for a in sys.argv[1:4])
    tensor, pipeline = int(sys.argv[4]), int(sys.argv[5])
    import transformers

    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import close_runner, open_runner
    from tests.scripts.make_hf_gpt import corpus

    runner = open_runner(model_file, tensor, pipeline, on_gpu=False)
    every_row = dataclasses.replace(runner, vocab_size=int(runner.chunks[0].vocab_size))
    batch = torch.randint(
        0, every_row.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1)
    )
    ours = every_row.logits(batch.tolist())
    prompts = [runner.tokenizer.encode(text) for text in PROMPTS]
    params = GenerationParams(tokens_to_generate=TOKENS, top_k=1)
    completions = generate(
        runner.logits, runner.tokenizer, PROMPTS, params, max_length=runner.max_length
    )
    ours_greedy = [c.tokens for c in completions]
    texts = corpus(60)
    ours_ids = [runner.tokenizer.encode(text) for text in texts]
    eod = runner.tokenizer.eod_id
    close_runner()
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return

    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
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
                suppress_tokens=list(range(runner.vocab_size, every_row.vocab_size)),
            )
            answer = out[0, len(prompt) :].tolist()
            theirs_greedy.append(answer[: answer.index(eod)] if eod in answer else answer)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    theirs_ids = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]

    from safetensors.torch import load_file

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion.convert import write_hf_files

    loaded = portable.read(model_file, Path(tempfile.mkdtemp()))
    export_dir.mkdir(parents=True)
    write_hf_files(export_dir, loaded.config, loaded.tensors)
    original = load_file(hf_dir / "model.safetensors")
    back = load_file(export_dir / "model.safetensors")
    again = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    print(
        json.dumps(
            {
                "logits": float((ours - reference).abs().max()),
                "greedy": [ours_greedy, theirs_greedy],
                "token_ids": ours_ids == theirs_ids,
                "keys_equal": sorted(original) == sorted(back),
                "missing": sorted(set(original) - set(back)),
                "tensors_equal": all(
                    torch.equal(original[k], back[k]) for k in original if k in back
                ),
                "class": type(again).__name__,
            }
        )
    )


if __name__ == "__main__":
    main()
