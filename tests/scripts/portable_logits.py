"""Logits of our model built from a portable file, on one process:

python -m tests.scripts.portable_logits MODEL.nemo INPUTS.pt OUT.pt [MODEL INPUTS OUT ...]

Several models in one process (three arguments each, one start-up for all), each built in turn.

INPUTS.pt holds a model's inputs by the names its batches use: `tokens` (GPT), `text`, `types`
and `padding_mask` (BERT), `text_enc` and `text_dec` (T5; id 0 is padding unless `enc_mask`
and `dec_mask` say which positions hold tokens: a Hugging Face T5's decoder starts at id 0).
OUT.pt gets
{"logits": ...} and, for BERT with its sentence-order head, {"order": ...}.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def outputs(chunk: Any, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if "tokens" in inputs:
        tokens = inputs["tokens"]
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        return {"logits": chunk(tokens, positions, None)}
    if "text_enc" in inputs:
        from launcher_scripts.jobs.models.t5_masks import attention_masks

        enc, dec = inputs["text_enc"], inputs["text_dec"]
        masks = attention_masks(inputs.get("enc_mask", enc != 0), inputs.get("dec_mask", dec != 0))
        return {"logits": chunk(enc, dec, *masks)}
    types = inputs["types"] if chunk.add_binary_head else None
    logits, order = chunk(inputs["text"], inputs["padding_mask"], tokentype_ids=types)
    return {"logits": logits} | ({} if order is None else {"order": order})


def main() -> None:
    args = sys.argv[1:]
    assert args and len(args) % 3 == 0, __doc__
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    from megatron.core import parallel_state

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.conversion import load
    from launcher_scripts.jobs.training import cpu_compat

    cpu_compat.patch_cuda_queries()
    cpu_compat.CudaDevicesOnCpu().__enter__()
    parallel_state.initialize_model_parallel(1, 1)
    cpu_compat.install()
    cpu_compat.seed_model_parallel_rngs(1)
    for at in range(0, len(args), 3):
        model_file, inputs_file, output = (Path(a) for a in args[at : at + 3])
        loaded = portable.read(model_file, Path(tempfile.mkdtemp()))
        chunks = load.build(loaded, 1, 1, on_gpu=False)
        with torch.no_grad():
            torch.save(outputs(chunks[0], torch.load(inputs_file)), output)


if __name__ == "__main__":
    main()
