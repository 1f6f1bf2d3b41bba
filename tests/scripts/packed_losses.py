"""Per-token losses of a few training samples, one per sequence and packed into one sequence:

python -m tests.scripts.packed_losses STAGE_HYDRA.yaml STAGE COUNT
prints one JSON line: the samples packed, positions used, and the largest difference between
the two ways of computing each sample's token losses.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from tests.scripts.tuner_setup import built_tuner


def packed_report(tuner: Any, count: int) -> dict[str, Any]:
    """The tuner's model (its data built) in eval mode on `count` validation samples, alone and
    packed: see the module's docstring."""
    from launcher_scripts.jobs.fine_tuning.packing import PackedSamples
    from launcher_scripts.jobs.fine_tuning.sft_data import MixedSamples, SftFile, to_tensors

    model = tuner.model[0].module
    model.eval()
    records = tuner.task.valid_records[:count]
    seq, pad = int(tuner.cfg.model.data.seq_length), tuner.task.tokenizer.eod_id

    def losses(item: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.unsqueeze(0) for k, v in item.items()}
        with torch.no_grad():
            out = model(
                batch["tokens"],
                batch["position_ids"],
                batch.get("attention_mask"),
                labels=batch["labels"],
            )
        return out[0][batch["loss_mask"][0] > 0]

    alone = torch.cat([losses(to_tensors(r.encoded, seq, pad)) for r in records])
    stream = MixedSamples([SftFile(None, records)], (1.0,), count, seq, pad, 0, False)  # type: ignore[arg-type]
    packed_set = PackedSamples(stream, 1, seq, pad)
    first, end = packed_set._span(0)
    packed = losses(packed_set[0])
    used = int((packed_set[0]["tokens"] != pad).sum())
    return {
        "packed": end - first,
        "positions_used": used,
        "max_difference": float((alone[: packed.numel()] - packed).abs().max()),
        "tokens": [alone.numel(), packed.numel()],
    }


def main() -> None:
    config, stage, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with built_tuner(config, stage) as tuner:
        tuner.model[0].module.eval()
        tuner.prepare_data()
        report = packed_report(tuner, count)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
