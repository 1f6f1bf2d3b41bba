"""An imported Hugging Face T5 against transformers, in one process:

python -m tests.scripts.hf_t5_check MODEL.nemo HF_DIR EXPORT_DIR [MODEL HF_DIR EXPORT_DIR ...]

Several models in one process (three arguments each; one start-up for all). For each, in
order, prints a line of JSON: `logits` the largest difference of the decoder's logits over a
padded batch (the decoder starting at id 0, as transformers' T5 does); `greedy` both sides'
greedy token ids for the same prompts; `tensors_equal`/`keys_equal` whether the portable file
written back as a Hugging Face directory (EXPORT_DIR) holds exactly the original tensors;
`token_ids` whether the tokenizer written back encodes as the original does.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

PROMPTS = ["the river runs north", "in the morning the village was quiet", "who founded the city"]


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, __doc__
    for at in range(0, len(args), 3):
        model_file, hf_dir, export_dir = (Path(a) for a in args[at : at + 3])
        print(json.dumps(check(model_file, hf_dir, export_dir)), flush=True)


def check(model_file: Path, hf_dir: Path, export_dir: Path) -> dict:
    import transformers
    from safetensors.torch import load_file

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion.convert import write_hf_files
    from launcher_scripts.jobs.inference.generation import GenerationParams, generate
    from launcher_scripts.jobs.inference.runner import close_runner
    from launcher_scripts.jobs.inference.served import open_served
    from launcher_scripts.jobs.models.t5_masks import attention_masks

    served = open_served(model_file, on_gpu=False)
    chunk = served.decoding.chunks[0]  # the Seq2SeqRunner's model
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir, dtype=torch.float32)
    theirs.eval()

    generator = torch.Generator().manual_seed(1)
    enc = torch.randint(3, 500, (2, 12), generator=generator)
    dec = torch.randint(3, 500, (2, 6), generator=generator)
    enc[:, 11], enc[1, 7], enc[1, 8:] = 1, 1, 0  # [EOS], and a shorter row padded
    dec[:, 0], dec[1, 4:] = 0, 0  # the decoder's start is the padding id
    enc_valid = enc != 0
    dec_valid = torch.ones_like(dec, dtype=torch.bool)
    dec_valid[1, 4:] = False
    with torch.no_grad():
        from launcher_scripts.jobs.training.cpu_compat import CudaDevicesOnCpu

        with CudaDevicesOnCpu():
            ours = chunk(enc, dec, *attention_masks(enc_valid, dec_valid))
        reference = theirs(
            input_ids=enc,
            attention_mask=enc_valid.long(),
            decoder_input_ids=dec,
            decoder_attention_mask=dec_valid.long(),
        ).logits
    # The checkpoint's rows; ours has the import's padding past them (rows TP needs).
    ours = ours[..., : reference.shape[-1]]
    difference = float((ours - reference).abs()[dec_valid].max())

    params = GenerationParams(tokens_to_generate=8, top_k=1)
    ours_greedy = [
        c.tokens
        for c in generate(
            served.decoding, served.tokenizer, PROMPTS, params, max_length=served.max_length
        )
    ]
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        # No cache: transformers sizes it by the encoder's layers, fewer than the decoder's here.
        out = theirs.generate(
            **batch, max_new_tokens=8, do_sample=False, num_beams=1, use_cache=False
        )
    eos = int(theirs.config.eos_token_id)
    theirs_greedy = []
    for row in out.tolist():
        answer = row[1:]
        theirs_greedy.append(answer[: answer.index(eos)] if eos in answer else answer)
    close_runner()

    loaded = portable.read(model_file, Path(tempfile.mkdtemp()))
    export_dir.mkdir(parents=True)
    write_hf_files(export_dir, loaded.config, loaded.tensors)
    original, back = (
        load_file(hf_dir / "model.safetensors"),
        load_file(export_dir / "model.safetensors"),
    )
    again = transformers.AutoTokenizer.from_pretrained(export_dir)
    text = "the river runs north <extra_id_0> to the sea"
    return {
        "logits": difference,
        "greedy": [ours_greedy, theirs_greedy],
        "keys_equal": sorted(original) == sorted(back),
        "tensors_equal": all(torch.equal(original[k], back[k]) for k in original if k in back),
        "token_ids": again(text).input_ids == tokenizer(text).input_ids,
        "class": type(theirs).__name__,
    }


if __name__ == "__main__":
    main()
