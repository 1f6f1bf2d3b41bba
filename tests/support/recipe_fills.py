"""Values a recipe leaves to the user, as a user gives them."""

from __future__ import annotations

# Values a recipe leaves to the user (`???`), as a user gives them on the command line.
FILLS: dict[tuple[str, str], list[str]] = {
    ("conversion", "hf_import"): ["conversion.hf_model_dir=/models/t5-small"],
    ("conversion", "hf_export"): ["conversion.run.model_train_name=Meta-Llama-3-8B"],
    ("fine_tuning", "gpt3/custom_task"): [
        "fine_tuning.model.data.train_ds.file_names=[/data/task/train.jsonl]",
        "fine_tuning.model.data.train_ds.concat_sampling_probabilities=[1.0]",
        "fine_tuning.model.data.validation_ds.file_names=[/data/task/val.jsonl]",
    ],
    **{
        ("fine_tuning", f"{family}/custom_task"): [
            f"fine_tuning.model.data.{split}_ds.{side}_file_name=/data/task/{split}_{side}.txt"
            for split in ("train", "validation")
            for side in ("src", "tgt")
        ]
        for family in ("t5", "mt5")
    },
}
