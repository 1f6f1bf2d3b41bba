"""Keys of NeMo's recipes that describe behaviour which is fixed here, each with the values that
say what runs, and what does.

The shipped recipes keep them, so a recipe reads as NeMo's and NeMo's commands that set them to
what runs here (`model.data.train_ds.num_workers=0`, `exp_manager.create_checkpoint_callback=True`)
work; any other value would be accepted and then ignored, so it is refused in one line with
what runs instead. Every key of every shipped recipe is either read by a program or fixed here
(tests/test_recipe_keys.py).

A path is within a stage's section; `*` stands for one key (train_ds, validation_ds, encoder...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from launcher_scripts.errors import ConfigError

TUNING = ("adapter_learning", "ia3_learning", "prompt_learning", "fine_tuning", "peft")
ALIGNMENT = ("dpo", "grpo", "rlhf_ppo", "rlhf_rm")
CONVERTED = (
    "checkpoints are megatron-core distributed checkpoints; the portable model file is the "
    "conversion stage's (stages=[...,conversion])"
)
TUNED_FILE = (
    "a tuning or alignment stage writes its model file once, at the end, from the last step's "
    "weights"
)
ONE_TASK = "one task per run: the recipe's data is the task's (multi-task prompt learning is not "
ONE_TASK += "implemented)"


def _one_name(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 1


@dataclass(frozen=True)
class Fixed:
    path: str
    accepts: tuple[Any, ...] | Callable[[Any], bool]
    meaning: str  # what runs here, whatever the key says
    groups: tuple[str, ...] = ()  # the stage groups it is for; empty: every one holding it
    shown: str = ""  # what `accepts` accepts, in words, when it is a predicate

    def allows(self, value: Any) -> bool:
        if callable(self.accepts):
            return self.accepts(value)
        # 1 == True in Python: a boolean key takes only booleans, a number only numbers.
        return any(
            value == accepted and isinstance(value, bool) == isinstance(accepted, bool)
            for accepted in self.accepts
        )

    def wanted(self) -> str:
        if callable(self.accepts):
            return self.shown
        return " or ".join(_literal(value) for value in self.accepts)


def _literal(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_literal, value)) + "]"
    return str(value)


FIXED: tuple[Fixed, ...] = (
    # ----- trainer --------------------------------------------------------------------------
    Fixed(
        "trainer.accumulate_grad_batches",
        (1,),
        "gradient accumulation follows from model.global_batch_size / (micro_batch_size x "
        "data-parallel size)",
    ),
    Fixed(
        "trainer.enable_checkpointing",
        (False,),
        "the training loop saves the checkpoints itself, as exp_manager.checkpoint_callback_params "
        "says (NeMo sets it false for the same reason)",
    ),
    Fixed(
        "trainer.use_distributed_sampler",
        (False,),
        "each data-parallel rank reads its share of every global batch (Megatron's sampler)",
    ),
    Fixed(
        "trainer.logger",
        (False,),
        "the loggers are exp_manager's: metrics.jsonl, TensorBoard, and W&B with "
        "exp_manager.create_wandb_logger",
    ),
    Fixed(
        "trainer.limit_test_batches",
        (0, 0.0),
        "no test pass follows pretraining (nor in NeMo's); test a model with the evaluation stage",
        ("training",),
    ),
    Fixed(
        "trainer.limit_test_batches",
        (1.0,),
        "the test pass after tuning answers every record of model.data.test_ds",
        TUNING,
    ),
    # ----- exp_manager ----------------------------------------------------------------------
    Fixed(
        "exp_manager.create_checkpoint_callback",
        (True,),
        "checkpoints are always saved: every checkpoint_callback_params.every_n_train_steps "
        "and on a stop signal",
    ),
    Fixed("exp_manager.exp_dir", (None,), "the run's folder is exp_manager.explicit_log_dir"),
    Fixed(
        "exp_manager.log_step_timing",
        (True,),
        "train_step_timing is always in metrics.jsonl, the mean over the steps since the "
        "previous log line",
    ),
    Fixed(
        "exp_manager.step_timing_kwargs.sync_cuda",
        (True,),
        "on GPUs each step is timed after torch.cuda.synchronize()",
    ),
    Fixed("exp_manager.checkpoint_callback_params.always_save_nemo", (False,), CONVERTED),
    Fixed(
        "exp_manager.checkpoint_callback_params.save_nemo_on_train_end",
        (False,),
        CONVERTED,
        ("training",),
    ),
    Fixed(
        "exp_manager.checkpoint_callback_params.save_nemo_on_train_end",
        (True,),
        TUNED_FILE,
        (*TUNING, *ALIGNMENT),
    ),
    Fixed(
        "exp_manager.checkpoint_callback_params.save_best_model",
        (False,),
        f"{TUNED_FILE}; no best checkpoint is picked",
        TUNING,
    ),
    Fixed("model.save_nemo_on_validation_end", (False,), TUNED_FILE, TUNING),
    Fixed(
        "model.resume_from_checkpoint",
        (None,),
        "a run resumes from the newest checkpoint in exp_manager.explicit_log_dir "
        "(exp_manager.resume_if_exists)",
    ),
    # ----- data -----------------------------------------------------------------------------
    *(
        Fixed(path, (0,), "batches are read in the training process (no loader workers)")
        for path in ("model.data.num_workers", "model.data.*.num_workers")
    ),
    *(
        Fixed(path, (False,), "batches are copied to the GPU from pageable memory")
        for path in ("model.data.pin_memory", "model.data.*.pin_memory")
    ),
    Fixed("model.data.train_ds.drop_last", (True,), "training reads whole global batches"),
    *(
        Fixed(
            f"model.data.{split}.drop_last",
            (False,),
            "validation reads every record (its last batch padded)",
        )
        for split in ("validation_ds", "test_ds")
    ),
    Fixed(
        "model.data.data_impl",
        ("mmap",),
        "indexed datasets are memory-mapped (megatron-core)",
        ("training",),
    ),
    Fixed(
        "model.data.skip_warmup",
        (True,),
        "the memory map is read on demand, never warmed up",
        ("training",),
    ),
    Fixed(
        "model.data.mean_ngram_size",
        (None,),
        "megatron-core's T5 dataset draws the span lengths itself, up to model.data.max_ngram_size",
        ("training",),
    ),
    Fixed(
        "model.data.respect_document_boundaries",
        (True,),
        "megatron-core's T5 dataset builds each sample from whole sentences of one document",
        ("training",),
    ),
    # ----- model ----------------------------------------------------------------------------
    Fixed(
        "model.gradient_as_bucket_view",
        (True,),
        "megatron-core's DDP always keeps the gradients as views into its contiguous buckets",
    ),
    Fixed(
        "model.megatron_amp_O2",
        (True,),
        "in bf16 and fp16 the optimizer always keeps fp32 main weights (megatron-core's "
        "mixed-precision optimizer, NeMo's O2)",
    ),
    Fixed(
        "model.use_emha",
        (False,),
        "Apex's efficient attention is not used: attention is megatron-core's (Transformer "
        "Engine's with transformer_engine=True)",
    ),
    Fixed("model.onnx_safe", (False,), "nothing is exported to ONNX here"),
    *(
        Fixed(
            name,
            (None,),
            "NeMo's partial activation checkpointing is not in megatron-core: recomputation "
            "follows activations_checkpoint_granularity, _method and _num_layers",
        )
        for name in (
            "model.num_micro_batches_with_partial_activation_checkpoints",
            "model.activations_checkpoint_layers_per_pipeline",
        )
    ),
    Fixed(
        "model.ffn_dropout",
        (0.0,),
        "megatron-core's MLP has no dropout of its own (hidden_dropout follows the block)",
        TUNING,
    ),
    Fixed(
        "model.optim.sched.reduce_on_plateau",
        (False,),
        "the learning rate follows optim.sched.name's schedule",
    ),
    # ----- tuning methods -------------------------------------------------------------------
    Fixed("model.existing_tasks", ([],), ONE_TASK, TUNING),
    Fixed("model.new_tasks", _one_name, ONE_TASK, TUNING, "a list of one task name"),
    *(
        Fixed(
            f"model.prompt_learning.{name}",
            (None,),
            "prompt tuning starts from random embeddings",
            ("prompt_learning",),
        )
        for name in ("new_prompt_init_methods", "new_prompt_init_text")
    ),
    *(
        Fixed(
            path,
            (False,),
            "every layer has its own adapter weights",
        )
        for path in ("model.peft.*.weight_tying",)
    ),
    Fixed(
        "model.peft.*.position_embedding_strategy",
        (None,),
        "adapter weights are not tied, so no position embedding tells layers apart",
    ),
    Fixed(
        "model.peft.p_tuning.embedding_dim",
        (None,),
        "the virtual tokens' embeddings have the base model's hidden size",
        ("peft",),
    ),
    # ----- a tuned model's evaluation -------------------------------------------------------
    Fixed(
        "data.ground_truth_file_path",
        (None,),
        "the answers scored against are the test file's own (original_answers, else output)",
        ("evaluation",),
    ),
    Fixed(
        "inference.add_BOS",
        (None,),
        "a prompt starts with BOS when the tuned model's data did (its data.*.add_bos)",
        ("evaluation",),
    ),
    Fixed(
        "inference.min_tokens_to_generate",
        (0,),
        "generation ends at the end-of-text token whenever it comes",
        ("evaluation",),
    ),
    *(
        Fixed(
            path,
            ("mixedfusedlayernorm", "layernorm"),
            "the adapter is a parallel adapter with a LayerNorm",
        )
        for path in ("model.adapter_tuning.norm_type", "model.peft.adapter_tuning.norm_type")
    ),
    # "type" is too common a name for the audit to tell it is unread: listed by hand.
    *(
        Fixed(
            path,
            ("parallel_adapter",),
            "the adapter is a parallel adapter (NeMo's linear_adapter is not implemented)",
        )
        for path in ("model.adapter_tuning.type", "model.peft.adapter_tuning.type")
    ),
)


def _plain(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def _found(section: Any, parts: list[str], prefix: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of each key the path's parts name in `section`."""
    if not parts:
        yield prefix, _plain(section)
        return
    if not isinstance(section, Mapping):
        return
    head, rest = parts[0], parts[1:]
    names = [str(name) for name in section] if head == "*" else [head]
    for name in names:
        if name in section:
            yield from _found(section[name], rest, f"{prefix}.{name}")


def check_fixed_keys(root: Any, stages: Sequence[str]) -> None:
    """Each fixed key of the stages' sections holds a value that says what runs here."""
    for stage in stages:
        section = root.get(stage)
        if section is None:
            continue
        for fixed in FIXED:
            if fixed.groups and stage not in fixed.groups:
                continue
            for key, value in _found(section, fixed.path.split("."), stage):
                if not fixed.allows(value):
                    raise ConfigError(
                        key,
                        f"{_literal(value)} is not what runs here: {fixed.meaning}",
                        f"Set it to {fixed.wanted()}, or leave it out",
                    )


def fixed_paths(group: str) -> list[str]:
    """The fixed paths of a stage group, for the audit of the shipped recipes."""
    return [fixed.path for fixed in FIXED if not fixed.groups or group in fixed.groups]
