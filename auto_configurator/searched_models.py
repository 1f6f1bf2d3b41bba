"""The two kinds of model the layout search describes, each answering candidates.SearchedModel:
a layer stack (GPT, BERT: costmodel.memory and costmodel.throughput) and an encoder-decoder
(T5, mT5: costmodel.encoder_decoder). A family says which it is (ModelFamily.encoder_decoder)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from auto_configurator.candidates import (
    AUTO_VIRTUAL_PIPELINE,
    ENCODER_DECODER_RULES,
    LONG_SEQUENCE,
    RULES,
    Rule,
    SearchedModel,
)
from auto_configurator.settings import TrainSettings
from launcher_scripts import families
from launcher_scripts.costmodel import encoder_decoder, memory, throughput
from launcher_scripts.costmodel.encoder_decoder import EncoderDecoderShape
from launcher_scripts.costmodel.memory import MemoryBreakdown
from launcher_scripts.costmodel.throughput import ClusterSpec, StepPrediction
from launcher_scripts.recipes.layout import Layout, read_layout
from launcher_scripts.recipes.model_shape import ModelShape, read_shape, tokenizer_vocab


@dataclass(frozen=True)
class StackModel:
    shape: ModelShape
    rules: tuple[Rule, ...] = RULES
    auto_virtual_pipeline: tuple[int | None, ...] = AUTO_VIRTUAL_PIPELINE

    def auto_pipeline(self, world: int) -> tuple[int, ...]:
        """The divisors of the layer count, up to the GPUs."""
        layers = self.shape.num_layers
        return tuple(d for d in range(1, layers + 1) if layers % d == 0 and d <= world)

    def auto_context(self) -> tuple[int, ...]:
        return (1, 2, 4, 8) if self.shape.seq_length >= LONG_SEQUENCE else (1,)

    def auto_expert(self, world: int) -> tuple[int, ...]:
        """The powers of two dividing the experts, up to the GPUs; (0,) without experts."""
        if self.shape.experts is None:
            return (0,)
        count = self.shape.experts.count
        return tuple(2**i for i in range(count.bit_length()) if count % 2**i == 0 and 2**i <= world)

    def memory(self, layout: Layout) -> MemoryBreakdown:
        return memory.memory_breakdown(self.shape, layout)

    def predict(self, layout: Layout, cluster: ClusterSpec) -> StepPrediction:
        return throughput.predict_step(self.shape, layout, cluster)

    def flops_per_step(self, layout: Layout) -> float:
        return throughput.model_flops_per_step(self.shape, layout)


@dataclass(frozen=True)
class EncoderDecoderModel:
    shape: EncoderDecoderShape
    rules: tuple[Rule, ...] = ENCODER_DECODER_RULES
    auto_virtual_pipeline: tuple[int | None, ...] = (None,)

    def auto_pipeline(self, world: int) -> tuple[int, ...]:
        """1, and one stage more than each divisor of the encoder's layers (the decoder's
        stage), up to the GPUs."""
        layers = self.shape.encoder.num_layers
        split = tuple(d + 1 for d in range(1, layers + 1) if layers % d == 0 and d < world)
        return (1, *split)

    def auto_context(self) -> tuple[int, ...]:
        return (1,)

    def auto_expert(self, world: int) -> tuple[int, ...]:
        """T5's experts are not split (the NeMo launcher's: no expert parallelism)."""
        del world
        return (0,)

    # One shape per recomputation setting (copying the recipe per candidate is what costs).
    _recomputed: dict[tuple, EncoderDecoderShape] = field(
        default_factory=dict, compare=False, repr=False
    )

    def _recomputing(self, layout: Layout) -> EncoderDecoderShape:
        """The shape with both blocks recomputing as the layout does (a T5 recipe says it per
        block; a candidate sets both)."""
        if layout.recompute == "full":
            method, layers = layout.recompute_method, layout.recompute_num_layers
        else:
            method, layers = None, None
        setting = (layout.recompute, method, layers)
        if setting not in self._recomputed:
            model = encoder_decoder.with_recompute(self.shape.model, *setting)
            self._recomputed[setting] = EncoderDecoderShape(model, self.shape.vocab_size)
        return self._recomputed[setting]

    def memory(self, layout: Layout) -> MemoryBreakdown:
        return encoder_decoder.memory_breakdown(self._recomputing(layout), layout)

    def predict(self, layout: Layout, cluster: ClusterSpec) -> StepPrediction:
        return encoder_decoder.predict_step(self._recomputing(layout), layout, cluster)

    def flops_per_step(self, layout: Layout) -> float:
        return encoder_decoder.model_flops_per_step(self.shape, layout)


def searched_model(
    training: DictConfig, settings: TrainSettings, prefix: str
) -> tuple[SearchedModel, Layout]:
    """The analytical model's view of a resolved training recipe, and its layout. The
    vocabulary is the tokenizer's when its file can be read now, else the search config's
    vocab_size."""
    model = OmegaConf.to_container(training.model, resolve=True)
    vocab, assumed = tokenizer_vocab(model.get("tokenizer") or {})
    vocab = settings.vocab_size if assumed else vocab
    layout = read_layout(OmegaConf.to_container(training, resolve=True), prefix)
    if families.of_model_type(settings.family).encoder_decoder:
        return EncoderDecoderModel(EncoderDecoderShape(OmegaConf.create(model), vocab)), layout
    shape = read_shape(model, vocab_size=vocab, prefix=f"{prefix}.model")
    return StackModel(shape), layout
