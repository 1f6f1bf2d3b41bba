"""T5's and mT5's side of fine-tuning: text to text.

A record's input goes to the encoder followed by [EOS]; the decoder reads [BOS] and the answer
and predicts the answer and [EOS] (the layout of T5's span-corruption samples, so a pretrained
model starts from what it knows). Inputs longer than the input limit lose their end; an answer
over the answer limit drops the record, or is cut with `truncation_field: answer`. Both are
counted in the split's report line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import OmegaConf

from launcher_scripts.formats.tokenizer import wordpiece_reference
from launcher_scripts.jobs.fine_tuning.peft import PeftSites
from launcher_scripts.jobs.fine_tuning.sft_data import Counts, Encoded, SampleMaker, SftFormat
from launcher_scripts.jobs.inference.runner import OpenedModel, inference_only
from launcher_scripts.jobs.inference.seq2seq import Seq2SeqRunner
from launcher_scripts.jobs.inference.served import ServedModel, forward_shape
from launcher_scripts.jobs.models.base import TuningSide


class T5Text:
    """Text as the base model's ids, and back: its tokenizer's own ids (a WordPiece vocab.txt
    or a SentencePiece model), then those its span-corruption vocabulary added past them."""

    def __init__(self, model: Any) -> None:
        from launcher_scripts.jobs.models.t5 import data_tokenizer

        vocab = data_tokenizer(OmegaConf.create({"model": model}))
        tokenizer = model.tokenizer
        self.processor: Any = None
        self.backend: Any = None
        if str(tokenizer.get("model") or "").endswith(".json"):  # Hugging Face's tokenizer.json
            from tokenizers import Tokenizer

            self.backend = Tokenizer.from_file(str(tokenizer.model))
        elif tokenizer.get("model"):
            import sentencepiece

            self.processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer.model))
        else:
            lower = "lowercase" in str(tokenizer.get("type") or "").lower()
            self.backend = wordpiece_reference(str(tokenizer.vocab_file), lower)
        self.vocab_size = vocab.vocab_size
        self.pad_id, self.bos_id, self.eos_id = vocab.pad, vocab.bos, vocab.eos
        self.eod_id = self.eos_id  # what ends an answer
        self.own = vocab.vocab_size - len(vocab.added)  # ids below are the tokenizer's
        self.specials = {self.pad_id, self.bos_id, self.eos_id}

    def encode(self, text: str) -> list[int]:
        if self.processor is not None:
            return list(self.processor.encode(text, out_type=int))
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the tokenizer's own ids; special ids and sentinels have none."""
        kept = [int(i) for i in ids if int(i) < self.own and int(i) not in self.specials]
        if self.processor is not None:
            return str(self.processor.decode(kept))
        return str(self.backend.decode(kept, skip_special_tokens=True))


class GenerationText:
    """T5Text as the generation engine reads a tokenizer: a prompt encodes to the encoder's
    ids (the first `encoder_length` - 1 of them, as training cuts inputs), [EOS] and the
    decoder's start ([BOS]); a row decodes to the answer after it."""

    def __init__(
        self, text: T5Text, encoder_length: int | None = None, prefix: Sequence[int] = ()
    ) -> None:
        self.text, self.encoder_length, self.prefix = text, encoder_length, list(prefix)
        self.vocab_size, self.eod_id = text.vocab_size, text.eos_id

    def encode(self, prompt: str) -> list[int]:
        ids = self.text.encode(prompt)
        if self.encoder_length is not None:
            ids = ids[: self.encoder_length - 1 - len(self.prefix)]
        return [*self.prefix, *ids, self.text.eos_id, self.text.bos_id]

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        start = len(ids) - ids[::-1].index(self.text.bos_id) if self.text.bos_id in ids else 0
        return self.text.decode(ids[start:])


def encode(
    tokenizer: T5Text, fmt: SftFormat, prompt: str, answer: str, counts: Counts, where: str
) -> Encoded | None:
    """ids: the encoder's (virtual-token placeholders, input, [EOS]) then the answer's;
    prompt_length splits them."""
    placeholders = [tokenizer.eod_id] * fmt.virtual_tokens
    source = tokenizer.encode(prompt)
    target = tokenizer.encode(answer)
    source_room = fmt.max_seq_length - 1 - len(placeholders)
    target_room = (fmt.max_target_length or fmt.max_seq_length) - 1  # [BOS] in, [EOS] out
    changed = False
    if len(target) > target_room:
        if fmt.truncation_field != "answer":
            counts.dropped_too_long += 1
            counts.note(where)
            return None
        target, changed = target[:target_room], True
    if len(source) > source_room:
        source, changed = source[:source_room], True
    if changed:
        counts.truncated += 1
        counts.note(where)
    encoder = [*placeholders, *source, tokenizer.eos_id]
    return Encoded([*encoder, *target], [0] * len(encoder) + [1] * len(target), len(encoder))


def sample_maker(cfg: Any, tokenizer: T5Text) -> SampleMaker:
    encoder_length = int(cfg.model.data.seq_length)
    decoder_length = int(cfg.model.data.seq_length_dec)

    def sample(encoded: Encoded | None) -> dict[str, torch.Tensor]:
        text_enc = torch.zeros(encoder_length, dtype=torch.long)
        text_dec = torch.zeros(decoder_length, dtype=torch.long)
        labels = torch.full((decoder_length,), -1, dtype=torch.long)
        loss_mask = torch.zeros(decoder_length, dtype=torch.float)
        encoder_tokens = decoder_tokens = 0
        if encoded is not None:  # None: padding of a validation batch, no loss
            split = encoded.prompt_length
            answer = encoded.ids[split:]
            text_enc[:split] = torch.tensor(encoded.ids[:split])
            text_dec[: len(answer) + 1] = torch.tensor([tokenizer.bos_id, *answer])
            labels[: len(answer) + 1] = torch.tensor([*answer, tokenizer.eos_id])
            loss_mask[: len(answer) + 1] = 1.0
            encoder_tokens, decoder_tokens = split, len(answer) + 1
        return {
            "text_enc": text_enc,
            "text_dec": text_dec,
            "labels": labels,
            "loss_mask": loss_mask,
            # Which positions hold a token (the decoder's start may be id 0: t5_masks.py).
            "enc_mask": (torch.arange(encoder_length) < encoder_tokens).long(),
            "dec_mask": (torch.arange(decoder_length) < decoder_tokens).long(),
        }

    return sample


def _runner(
    chunks: list[Any], text: T5Text, tensor: int, pipeline: int, sp: bool, on_gpu: bool
) -> Seq2SeqRunner:
    """The model answering rows whose encoder part ends at the decoder's start id."""
    return Seq2SeqRunner(
        chunks=chunks,
        start_id=text.bos_id,
        vocab_size=text.vocab_size,
        tensor=tensor,
        pipeline=pipeline,
        sequence_parallel=sp,
        on_gpu=on_gpu,
    )


def generation(
    cfg: Any, chunks: list[Any], tokenizer: T5Text, par: Any, on_gpu: bool, prefix: list[int]
) -> tuple[Any, Any, int]:
    """The encoder reads the prompt (behind `prefix`, cut as training cuts it) and the decoder
    generates."""
    runner = _runner(chunks, tokenizer, par.tensor, par.pipeline, par.sequence_parallel, on_gpu)
    encoder_length = int(cfg.model.data.seq_length)
    # Every prompt fits: its encoder part is cut to the encoder's length, and the decoder's
    # start and answer follow it.
    positions = encoder_length + 1 + int(cfg.model.data.seq_length_dec)
    return runner, GenerationText(tokenizer, encoder_length, prefix), positions


def served(opened: OpenedModel) -> ServedModel:
    """The encoder reads the whole prompt and the decoder writes the answer, each within the
    model's positions: a prompt too long is refused, not cut, so that a client learns it."""
    text = T5Text(opened.config)
    positions = int(opened.config.max_position_embeddings)
    inference_only(opened.chunks)
    runner = _runner(opened.chunks, text, opened.tensor, opened.pipeline, False, opened.on_gpu)

    def too_long(row_tokens: int, tokens_to_generate: int) -> str | None:
        encoder = row_tokens - 1  # the prompt's ids and [EOS]; the decoder's start follows
        if encoder > positions:
            return (
                f"the prompt is {encoder - 1} tokens: with its end token more than the "
                f"encoder's {positions} positions. Shorten the prompt"
            )
        if tokens_to_generate > positions:
            return (
                f"tokens_to_generate is {tokens_to_generate}: more than the decoder's "
                f"{positions} positions. Lower it"
            )
        return None

    return ServedModel(
        decoding=runner,
        tokenizer=GenerationText(text),
        max_length=2 * positions + 1,  # too_long bounds each part
        shape=forward_shape(opened.chunks[0], opened.tensor, text.vocab_size, opened.on_gpu),
        on_gpu=opened.on_gpu,
        too_long=too_long,
    )


def _stacks(chunk: Any) -> list[tuple[str, Any]]:
    """The encoder's and the decoder's layers this stage holds, keyed apart."""
    layers = []
    for name in ("encoder", "decoder"):
        stack = getattr(chunk, name, None) if getattr(chunk, f"add_{name}") else None
        layers += [(f"{name}.", layer) for layer in stack.layers] if stack is not None else []
    return layers


# Virtual tokens start the encoder's input (the decoder's shares the embedding: it stays).
PEFT_SITES = PeftSites(
    layers=_stacks,
    prompt=lambda chunk: (chunk.encoder, True) if chunk.pre_process and chunk.add_encoder else None,
)

TUNING = TuningSide(
    text_tokenizer=T5Text,
    encode=encode,
    sample_maker=sample_maker,
    generation=generation,
    chat=False,
    peft_sites=PEFT_SITES,
)
