"""TRL's DPOTrainer on our tuned policy and its reference, exported to Hugging Face, over the
pairs a dpo run wrote with its test metrics (test_logps.jsonl: the token ids each side read):

python -m tests.scripts.dpo_trl_check POLICY.nemo REFERENCE.nemo TEST_LOGPS.jsonl WORK_DIR \
    BETA LOSS_TYPES LOSS_WEIGHTS
prints one JSON object: TRL's loss and its metrics, computed by DPOTrainer._compute_loss in
fp32 over one batch of every pair (LOSS_TYPES and LOSS_WEIGHTS: comma-separated, as
DPOConfig takes them: sigmoid; ipo; sigmoid,sft for RPO).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import launcher_scripts.families  # noqa: F401  (the families' tensor shapes)
from launcher_scripts.jobs.conversion.convert import write_hf_from_portable


def main() -> None:
    policy_file, reference_file, pairs_file, work = (Path(a) for a in sys.argv[1:5])
    beta = float(sys.argv[5])
    loss_types = sys.argv[6].split(",")
    weights = [float(w) for w in sys.argv[7].split(",")]
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(
        write_hf_from_portable(policy_file, work / "policy")
    )
    reference = AutoModelForCausalLM.from_pretrained(
        write_hf_from_portable(reference_file, work / "reference")
    )
    tokenizer = AutoTokenizer.from_pretrained(work / "policy")
    args = DPOConfig(
        output_dir=str(work / "trl"),
        beta=beta,
        loss_type=loss_types,
        loss_weights=weights,
        report_to=[],
        use_cpu=True,
        bf16=False,  # its default on a CPU with bf16: the comparison is in fp32
    )
    unused = Dataset.from_dict({"prompt": ["a"], "chosen": [" b"], "rejected": [" c"]})
    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=unused,
        processing_class=tokenizer,
    )  # fmt: skip
    rows = [json.loads(line) for line in pairs_file.read_text().splitlines()]
    sides = [r["prompt_ids"] + r["chosen_ids"] for r in rows]
    sides += [r["prompt_ids"] + r["rejected_ids"] for r in rows]
    prompts = [len(r["prompt_ids"]) for r in rows] * 2
    longest = max(map(len, sides))
    ids = torch.zeros((len(sides), longest), dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (side, prompt) in enumerate(zip(sides, prompts, strict=True)):
        ids[row, : len(side)] = torch.tensor(side)
        attention[row, : len(side)] = 1
        completion[row, prompt : len(side)] = 1
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    trainer.model.eval()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs, False)
    metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items()}
    print(json.dumps({"loss": float(loss), **metrics}))


if __name__ == "__main__":
    main()
