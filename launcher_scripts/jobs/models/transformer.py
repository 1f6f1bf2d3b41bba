"""What every family's megatron-core model is built from: the recipe's `model` section as a
TransformerConfig, the activations and dtypes it names, and the norms that run without Apex
or Transformer Engine. Each family's module (gpt.py, t5.py, bert.py) builds its model on it."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from launcher_scripts.costmodel import estimates
from launcher_scripts.jobs.training import mcore_mends
from launcher_scripts.jobs.training.runtime import JobError
from launcher_scripts.recipes import training as recipe
from launcher_scripts.recipes.layout import read_layout
from launcher_scripts.recipes.model_shape import Experts, read_shape


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU's tanh approximation (Hugging Face's gelu_new: GPT-2's, T5 v1.1's and mT5's)."""
    return F.gelu(x, approximate="tanh")


# Which of them is gated (fc1 gives value and gate) is portable_check.GATED_ACTIVATIONS,
# shared with the file checks and the model's shape.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu-tanh": gelu_tanh,  # GPT-2's own (Hugging Face's gelu_new)
    "relu": F.relu,
    "squared-relu": squared_relu,
    "swiglu": F.silu,
    "fast-swiglu": F.silu,
    "geglu": F.gelu,
    "geglu-tanh": gelu_tanh,
    "fast-geglu": F.gelu,
    "reglu": F.relu,
    "fast-reglu": F.relu,
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class LocalNorm(torch.nn.Module):
    """LayerNorm, LayerNorm1p or RMSNorm without Apex or Transformer Engine.

    megatron-core's torch fallback refuses zero-centred gamma (layernorm1p) and sequence
    parallelism; this one supports both. Under sequence parallelism each TP rank sees a
    different slice of the sequence, so the weights are marked for megatron-core to all-reduce
    their gradients across the TP group.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__()
        self.rms = config.normalization == "RMSNorm"
        self.zero_centered = config.layernorm_zero_centered_gamma
        self.eps = eps
        init = torch.zeros if self.zero_centered else torch.ones
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.rms:
            return F.rms_norm(hidden, (hidden.shape[-1],), weight, self.eps)
        return F.layer_norm(hidden, (hidden.shape[-1],), weight, self.bias, self.eps)


class ExpertOutputLinear(RowParallelLinear):
    """A routed expert's fc2 in megatron-core's local layers. Its MLP adds the bias (weighted
    by the routing probability) to this output in place; with one expert-TP rank the output is
    the reduction's input handed back as a view, which autograd refuses to modify in place. A
    biased expert's output gets a tensor of its own."""

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        output, bias = super().forward(input_, *args, **kwargs)
        return (output if bias is None else output.clone()), bias


def use_local_experts(layer: ModuleSpec) -> None:
    """A MoE layer spec of megatron-core's local modules, its experts' fc2 mended (above) and
    its pre-MLP norm stored under Transformer Engine's key (`pre_mlp_layernorm.weight`: a MoE
    layer has no fc1 to fuse it into), so that a checkpoint or portable file written on CPU
    loads on GPUs and back."""
    experts = layer.submodules.mlp.submodules.experts
    experts.submodules.linear_fc2 = ExpertOutputLinear
    keys = layer.submodules.sharded_state_dict_keys_map
    layer.submodules.sharded_state_dict_keys_map = {
        old: new for old, new in keys.items() if old != "pre_mlp_layernorm."
    }


def separate_expert_parameters(chunks: list[torch.nn.Module]) -> bool:
    """Marks the routed experts' parameters as megatron-core marks them under expert
    parallelism (reduced over the expert-data-parallel group, stepped by an optimizer of their
    own), at EP 1 too; whether the chunks have experts. At EP 1 that group is the data-parallel
    one, so training is the same; what changes is that a MoE model's optimizer is the same
    chain (dense, experts) at every EP, so a checkpoint resumes at another EP."""
    found = False
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for param in module.experts.parameters():
                    param.allreduce = False  # type: ignore[attr-defined]
                    found = True
    return found


def transformer_config(cfg: Any, use_te: bool, on_gpu: bool) -> TransformerConfig:
    model = cfg.model
    layout = read_layout(cfg)
    # The config holds neither the vocabulary nor the sequence length.
    shape = read_shape(model, vocab_size=1, prefix="training.model", seq_length=1)
    dtype_name = recipe.precision(cfg)
    activation = ACTIVATIONS[model.activation]
    granularity = model.get("activations_checkpoint_granularity")
    fp8 = None
    if model.get("fp8"):
        if not use_te:
            raise JobError(
                "training.model.fp8 needs Transformer Engine, which does not import here: "
                "set fp8=False or use a container with transformer_engine"
            )
        # NeMo's order: fp8_e4m3 first, then fp8_hybrid (E4M3 forward, E5M2 backward).
        fp8 = "e4m3" if model.get("fp8_e4m3") or not model.get("fp8_hybrid") else "hybrid"
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        # None: 1/sqrt(head size); an imported T5 has 1.0 (its query weights hold the scale)
        softmax_scale=model.get("softmax_scale"),
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        layernorm_epsilon=model.get("layernorm_epsilon", 1e-5),
        normalization="RMSNorm" if model.normalization == "rmsnorm" else "LayerNorm",
        layernorm_zero_centered_gamma=model.normalization == "layernorm1p",
        add_bias_linear=shape.bias,
        qk_layernorm=shape.qk_layernorm,
        # Qwen2's (and some StableLM's) biases on Q, K and V alone
        add_qkv_bias=bool(model.get("qkv_bias", False)),
        gated_linear_unit=shape.gated_mlp,
        activation_func=activation,
        apply_query_key_layer_scaling=bool(model.get("apply_query_key_layer_scaling", False))
        and dtype_name == "fp16",
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=DTYPES[dtype_name],
        pipeline_dtype=DTYPES[dtype_name],
        fp16=dtype_name == "fp16",
        bf16=dtype_name == "bf16",
        autocast_dtype=DTYPES[dtype_name],
        use_cpu_initialization=bool(model.get("use_cpu_initialization", not on_gpu)) or not on_gpu,
        perform_initialization=True,
        recompute_granularity=granularity,
        recompute_method=model.get("activations_checkpoint_method")
        if granularity == "full"
        else None,
        recompute_num_layers=(
            model.get("activations_checkpoint_num_layers") if granularity == "full" else None
        ),
        fp8=fp8,
        fp8_margin=model.get("fp8_margin", 0),
        fp8_interval=model.get("fp8_interval", 1),
        fp8_amax_history_len=model.get("fp8_amax_history_len", 1024),
        fp8_amax_compute_algo=model.get("fp8_amax_compute_algo", "max"),
        calculate_per_token_loss=True,
        # The fused kernels need CUDA (and some Apex); on CPU the plain paths run.
        bias_activation_fusion=on_gpu and model.activation == "gelu" and use_te,
        masked_softmax_fusion=on_gpu and use_te and bool(model.get("masked_softmax_fusion", True)),
        bias_dropout_fusion=on_gpu and bool(model.get("bias_dropout_add_fusion", True)),
        # The residual stream kept in fp32 under bf16/fp16 (NeMo's fp32_residual_connection).
        fp32_residual_connection=bool(model.get("fp32_residual_connection", False)),
        apply_rope_fusion=False,
        # Apex's persistent LayerNorm kernel, on GPUs (megatron-core falls back without Apex).
        persist_layer_norm=on_gpu and bool(model.get("persist_layer_norm", False)),
        gradient_accumulation_fusion=False,
        # Freeing a sent activation early is safe on CUDA streams, but gloo sends from its own
        # thread and could still be reading it.
        deallocate_pipeline_outputs=on_gpu,
        **expert_settings(shape.experts, use_te, on_gpu),
    )


def expert_settings(experts: Experts | None, use_te: bool, on_gpu: bool) -> dict[str, Any]:
    """megatron-core's MoE settings for the model's experts (none for a dense model)."""
    if experts is None:
        return {}
    mcore_mends.moe_without_te()
    return {
        "num_moe_experts": experts.count,
        "moe_router_topk": experts.top_k,
        "moe_ffn_hidden_size": experts.ffn_hidden_size,
        "moe_shared_expert_intermediate_size": experts.shared_ffn_hidden_size or None,
        "moe_shared_expert_gate": experts.shared_gate,
        "moe_layer_freq": experts.pattern,
        "moe_router_pre_softmax": experts.pre_softmax,
        "moe_router_load_balancing_type": experts.balancing,
        "moe_aux_loss_coeff": experts.aux_loss_coeff,
        "moe_z_loss_coeff": experts.z_loss_coeff,
        "moe_expert_capacity_factor": experts.capacity_factor,
        # With a capacity, megatron-core drops what exceeds it; padding every expert's input
        # to the capacity keeps shapes static (what its docs advise with a capacity factor).
        "moe_pad_expert_input_to_capacity": experts.capacity_factor is not None,
        "moe_token_dispatcher_type": experts.dispatcher,
        # Grouped GEMM needs CUDA kernels (Transformer Engine's or the grouped_gemm package);
        # on the CPU the experts run one after the other (SequentialMLP), the same numbers.
        "moe_grouped_gemm": experts.grouped_gemm and on_gpu and use_te,
        "moe_router_dtype": "fp32",  # routing decided in fp32 whatever the precision
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
    }


def padded_vocab_size(vocab_size: int, cfg: Any) -> int:
    return estimates.padded_vocab(vocab_size, cfg.model, read_layout(cfg).tensor)


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    """This rank's parameters (shared embeddings counted once per chunk that holds them)."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
