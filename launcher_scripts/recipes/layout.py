"""How one training run spreads its model over GPUs and what it keeps in memory: the one view
of a recipe's parallel sizes, batch, precision and recomputation, read once (`read_layout`) and
handed to the checks, the plan, the AutoConfigurator and the job's trainer.

Megatron-core's process groups: TP x CP x DP x PP ranks for the dense layers, and for the
experts of MoE layers expert TP x EP x expert-DP x PP over the same ranks (the "MoE parallel
folding" of megatron-core's parallel_state): the experts may be split over other ranks than
attention is. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher_scripts.config.checks import require_heads_split, require_int
from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.model_shape import Experts, ModelShape, as_bool
from launcher_scripts.recipes.precision import PRECISIONS, dtype_of

RECOMPUTE_GRANULARITIES = ("selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")


@dataclass(frozen=True)
class Layout:
    num_nodes: int
    gpus_per_node: int
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    context: int = 1
    expert: int = 1  # expert parallelism: each EP rank holds 1/EP of a MoE layer's experts
    expert_tensor: int | None = None  # each expert's TP split; None: TP's
    sequence_parallel: bool = False
    micro_batch: int = 1
    global_batch: int = 1
    recompute: str | None = None  # None | "selective" | "full"
    distributed_optimizer: bool = True
    precision: str = "bf16"  # "bf16" | "fp16" | "fp32" (and NeMo's "16", "32", "bf16-mixed"...)
    # Full recompute only (megatron's recompute_method / recompute_num_layers): "uniform"
    # checkpoints the input of every group of `recompute_num_layers` layers; "block"
    # checkpoints the first `recompute_num_layers` layers of each pipeline stage (chunk) and
    # keeps everything of the others.
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # Gradients accumulated and reduced in fp32 (megatron-core's grad_reduce_in_fp32, which
    # this launcher's trainer sets for fp16 and bf16); False: in the parameters' dtype.
    fp32_grads: bool = True

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    @property
    def data(self) -> int:
        return self.world_size // self.model_parallel

    @property
    def expert_tensor_size(self) -> int:
        return self.expert_tensor or self.tensor

    @property
    def expert_data(self) -> int:
        """The experts' data-parallel size: the ranks holding the same experts."""
        return self.world_size // (self.expert_tensor_size * self.expert * self.pipeline)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step and data-parallel rank (gradient accumulation), at least 1."""
        return max(1, self.global_batch // (self.micro_batch * self.data))

    @property
    def dtype(self) -> str:
        """The precision as "bf16", "fp16" or "fp32"."""
        return PRECISIONS.get(str(self.precision), str(self.precision))

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight or activation element."""
        return 4 if self.dtype == "fp32" else 2


def key(stage: str, name: str) -> str:
    return f"{stage}.{name}" if stage else name


def read_layout(cfg: Mapping, stage: str = "training") -> Layout:
    """A recipe's `trainer` and `model` sections (`stage` before the keys errors name; "" for
    none)."""
    trainer, model = cfg["trainer"], cfg["model"]

    def size(name: str) -> int:
        value = model.get(name)
        return 1 if value is None else require_int(key(stage, f"model.{name}"), value)

    precision = str(trainer.get("precision", "bf16"))
    dtype_of(precision, key(stage, "trainer.precision"))
    granularity, method = read_recompute(model, stage)
    layers = model.get("activations_checkpoint_num_layers")
    vp = model.get("virtual_pipeline_model_parallel_size")
    expert_tensor = model.get("expert_tensor_parallel_size")
    optim = model.get("optim") or {}
    return Layout(
        num_nodes=require_int(key(stage, "trainer.num_nodes"), trainer.get("num_nodes")),
        gpus_per_node=require_int(key(stage, "trainer.devices"), trainer.get("devices")),
        tensor=size("tensor_model_parallel_size"),
        pipeline=size("pipeline_model_parallel_size"),
        virtual_pipeline=None if vp in (None, 1) else size("virtual_pipeline_model_parallel_size"),
        context=size("context_parallel_size"),
        expert=size("expert_model_parallel_size"),
        expert_tensor=None if expert_tensor is None else size("expert_tensor_parallel_size"),
        sequence_parallel=as_bool(
            model.get("sequence_parallel", False), key(stage, "model.sequence_parallel")
        ),
        # An inference section has no batch; a training recipe's is checked where it is read
        # (recipes.training.check_batch).
        micro_batch=size("micro_batch_size"),
        global_batch=size("global_batch_size"),
        recompute=granularity,
        distributed_optimizer=str(optim.get("name", "")) == "distributed_fused_adam",
        precision=precision,
        recompute_method=method or "uniform",
        recompute_num_layers=1
        if layers is None
        else require_int(key(stage, "model.activations_checkpoint_num_layers"), layers, 0),
    )


def read_recompute(block: Any, stage: str, prefix: str = "model") -> tuple[str | None, str | None]:
    """A section's (recompute granularity, full recompute's method)."""
    granularity = block.get("activations_checkpoint_granularity")
    if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(
            key(stage, f"{prefix}.activations_checkpoint_granularity"),
            f"{granularity!r} is not valid",
            "Use selective, full or null",
        )
    method = block.get("activations_checkpoint_method")
    if granularity == "full" and method not in RECOMPUTE_METHODS:
        raise ConfigError(
            key(stage, f"{prefix}.activations_checkpoint_method"),
            f"{method!r} is not valid with full recompute",
            "Use uniform or block",
        )
    return granularity, method


def check_world(layout: Layout, stage: str) -> None:
    """The parallel sizes fit the processes and each other."""
    if layout.world_size % layout.model_parallel:
        raise ConfigError(
            key(stage, "model.tensor_model_parallel_size"),
            f"TP {layout.tensor} x PP {layout.pipeline} x CP {layout.context} = "
            f"{layout.model_parallel} does not divide the {layout.world_size} processes "
            "(num_nodes x devices)",
            "Change the parallel sizes or trainer.devices/num_nodes so that it divides",
        )
    expert_group = layout.expert * layout.expert_tensor_size * layout.pipeline
    if layout.world_size % expert_group:
        raise ConfigError(
            key(stage, "model.expert_model_parallel_size"),
            f"EP {layout.expert} x expert TP {layout.expert_tensor_size} x PP {layout.pipeline} "
            f"= {expert_group} does not divide the {layout.world_size} processes",
            "Choose expert parallel sizes whose product with PP divides num_nodes x devices",
        )
    if layout.virtual_pipeline and layout.pipeline < 2:
        raise ConfigError(
            key(stage, "model.virtual_pipeline_model_parallel_size"),
            "needs pipeline_model_parallel_size >= 2",
            "Set it to null, or raise pipeline_model_parallel_size",
        )
    if layout.sequence_parallel and layout.tensor < 2:
        raise ConfigError(
            key(stage, "model.sequence_parallel"),
            "needs tensor_model_parallel_size >= 2",
            "Set sequence_parallel=False, or raise tensor_model_parallel_size",
        )


def check_experts(
    experts: Experts | None, layout: Layout, stage: str, bias: bool, prefix: str = "model"
) -> None:
    """EP splits the experts evenly, expert TP their MLPs; a dense model has EP 1."""
    if experts is None:
        if layout.expert > 1:
            raise ConfigError(
                key(stage, "model.expert_model_parallel_size"),
                f"is {layout.expert} but the model has no experts ({prefix}.num_moe_experts "
                "is not set)",
                "Set it to 1, or give the model experts (num_moe_experts)",
            )
        return
    if experts.count % layout.expert:
        raise ConfigError(
            key(stage, "model.expert_model_parallel_size"),
            f"{layout.expert} does not divide the {experts.count} experts",
            "Choose a divisor of num_moe_experts",
        )
    if experts.ffn_hidden_size % layout.expert_tensor_size:
        raise ConfigError(
            key(stage, "model.expert_tensor_parallel_size"),
            f"{layout.expert_tensor_size} does not divide the experts' width "
            f"{experts.ffn_hidden_size} (moe_ffn_hidden_size)",
            "Choose a divisor, or set expert_tensor_parallel_size=1",
        )
    if layout.tensor > 1 and not layout.sequence_parallel:
        raise ConfigError(
            key(stage, "model.sequence_parallel"),
            f"is false with tensor_model_parallel_size {layout.tensor}, and megatron-core trains "
            "MoE layers under TP only with sequence parallelism (each TP rank routes its own "
            "share of the tokens)",
            "Set sequence_parallel=true",
        )
    if bias and layout.expert_tensor_size > 1:
        raise ConfigError(
            key(stage, "model.expert_tensor_parallel_size"),
            f"is {layout.expert_tensor_size} (null: TP's), but megatron-core's experts have "
            f"biases ({prefix}.bias=true) only when each expert is whole on a rank",
            "Set expert_tensor_parallel_size=1 (experts split over EP instead), or bias=false "
            "(as Mixtral, Qwen-MoE and DeepSeek have none)",
        )


def check_layout(shape: ModelShape, layout: Layout, stage: str = "") -> None:
    """Megatron's divisibility rules for a stack, each failure one ConfigError naming the key."""
    require_heads_split(
        key(stage, "model.tensor_model_parallel_size"),
        layout.tensor,
        shape.num_attention_heads,
        shape.query_groups,
    )
    rules = [
        (
            shape.ffn_hidden_size % layout.tensor == 0,
            "model.tensor_model_parallel_size",
            f"{layout.tensor} does not divide ffn_hidden_size {shape.ffn_hidden_size}",
            "Use a divisor of model.ffn_hidden_size",
        ),
        (
            shape.num_layers % (layout.pipeline * (layout.virtual_pipeline or 1)) == 0,
            "model.pipeline_model_parallel_size",
            f"PP {layout.pipeline} x VP {layout.virtual_pipeline or 1} does not divide the "
            f"{shape.num_layers} layers",
            "Use sizes whose product divides model.num_layers",
        ),
        (
            shape.seq_length % layout.context == 0,
            "model.context_parallel_size",
            f"{layout.context} does not divide the sequence length {shape.seq_length}",
            "Use a divisor of model.encoder_seq_length",
        ),
    ]
    for ok, name, problem, fix in rules:
        if not ok:
            raise ConfigError(key(stage, name), problem, fix)
    check_world(layout, stage)
    check_experts(shape.experts, layout, stage, shape.bias)
    per_step = layout.micro_batch * layout.data
    if layout.global_batch % per_step:
        raise ConfigError(
            key(stage, "model.global_batch_size"),
            f"{layout.global_batch} is not a multiple of micro_batch_size x data-parallel size "
            f"= {per_step}",
            f"Use a multiple of {per_step}",
        )
