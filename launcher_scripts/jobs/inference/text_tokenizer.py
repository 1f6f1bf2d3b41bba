"""The model's tokenizer for text in and text out (data preparation only ever encodes).

Ids are those training saw: no BOS and no post-processor template, documents end with the EOD
id. The tokenizer section is the one a model config carries (the recipe's, or a portable
file's with paths made absolute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher_scripts.formats.tokenizer import (
    TokenizerError,
    gpt2_reference,
    resolve_eod,
)


@dataclass
class TextTokenizer:
    backend: Any  # a SentencePieceProcessor or a tokenizers.Tokenizer
    vocab_size: int
    eod_id: int
    kind: str  # sentencepiece | tokenizers

    def encode(self, text: str) -> list[int]:
        if self.kind == "sentencepiece":
            return list(self.backend.encode(text, out_type=int))
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.kind == "sentencepiece":
            return [list(ids) for ids in self.backend.encode(list(texts), out_type=int)]
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [list(encoding.ids) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        if self.kind == "sentencepiece":
            return str(self.backend.decode([int(i) for i in ids]))
        return str(self.backend.decode([int(i) for i in ids], skip_special_tokens=False))


def load_text_tokenizer(section: Any) -> TextTokenizer:
    """From a model config's `tokenizer` section: a SentencePiece or tokenizer.json `model`, or
    GPT-2 `vocab_file` + `merge_file`. TokenizerError names what is missing."""
    model = section.get("model")
    eod_token = section.get("eod_token")
    if model and str(model).endswith(".json"):
        import tokenizers

        path = _existing(str(model))
        backend = tokenizers.Tokenizer.from_file(str(path))
        return _from_tokenizers(backend, eod_token, str(path))
    if model:
        import sentencepiece

        path = _existing(str(model))
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        eod = processor.piece_to_id(eod_token) if eod_token else processor.eos_id()
        if eod < 0:
            raise TokenizerError(f"{path} has no eos piece: set tokenizer.eod_token")
        return TextTokenizer(processor, processor.get_piece_size(), int(eod), "sentencepiece")
    if section.get("vocab_file") and section.get("merge_file"):
        backend = gpt2_reference(str(section.vocab_file), str(section.merge_file), eod_token)
        return _from_tokenizers(backend, eod_token, str(section.vocab_file))
    raise TokenizerError(
        "the model config names no tokenizer: set tokenizer.model, or tokenizer.vocab_file "
        "and tokenizer.merge_file"
    )


def _from_tokenizers(backend: Any, eod_token: str | None, source: str) -> TextTokenizer:
    eod = resolve_eod(backend, eod_token, source)
    return TextTokenizer(backend, backend.get_vocab_size(with_added_tokens=True), eod, "tokenizers")


def _existing(path: str) -> Path:
    resolved = Path(path)
    if not resolved.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    return resolved
