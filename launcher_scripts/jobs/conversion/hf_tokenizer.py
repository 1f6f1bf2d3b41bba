"""The training tokenizer as files transformers' AutoTokenizer loads, giving the same ids.

tokenizer.json (imported)      -> tokenizer.json + its settings, or the imported ones
SentencePiece .model           -> tokenizer.model + LlamaTokenizer settings without BOS/EOS
GPT-2 BPE (vocab + merges)     -> vocab.json, merges.txt + GPT2Tokenizer settings
WordPiece vocab.txt (BERT, T5) -> vocab.txt + BertTokenizer settings (the casing trained with)

A model's tokens past its tokenizer's own (T5's sentinels) are added as special tokens, in id
order, so that they get the model's ids.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from launcher_scripts.errors import ConfigError


def write(model: Any, directory: Path, added: tuple[str, ...] = ()) -> dict[str, int]:
    """Write the tokenizer files into `directory`; returns token ids for config.json. An
    imported model's own tokenizer_config.json (tokenizer.hf_config) is written back as it
    came, over the settings made here."""
    ids = _files(model, directory, added)
    recorded = model.tokenizer.get("hf_config")
    if recorded:
        shutil.copy2(str(recorded), directory / "tokenizer_config.json")
    return ids


def _files(model: Any, directory: Path, added: tuple[str, ...]) -> dict[str, int]:
    tokenizer = model.tokenizer
    library = str(tokenizer.get("library") or "")
    if tokenizer.get("type") == "hf_t5":  # an imported T5's own tokenizer, back as it came
        return _hf_t5(Path(str(tokenizer.model)), directory, model, added)
    if str(tokenizer.get("model") or "").endswith(".json"):
        return _hf_json(Path(str(tokenizer.model)), directory, model)
    if library == "sentencepiece":
        return _sentencepiece(Path(str(tokenizer.model)), directory, model, added)
    if tokenizer.get("vocab_file") and tokenizer.get("merge_file") and not added:
        return _gpt2(
            Path(str(tokenizer.vocab_file)), Path(str(tokenizer.merge_file)), directory, model
        )
    if tokenizer.get("vocab_file") and not tokenizer.get("merge_file"):
        return _wordpiece(Path(str(tokenizer.vocab_file)), directory, model, added)
    raise ConfigError(
        "training.model.tokenizer",
        f"library {library!r} has no Hugging Face equivalent here",
        "Use a SentencePiece model, GPT-2 BPE files (vocab_file and merge_file) or a "
        "WordPiece vocab.txt (vocab_file alone)",
    )


def _settings(directory: Path, settings: dict[str, Any], added: tuple[str, ...]) -> None:
    if added:
        settings["additional_special_tokens"] = list(added)
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def _wordpiece(source: Path, directory: Path, model: Any, added: tuple[str, ...]) -> dict[str, int]:
    tokens = source.read_text(encoding="utf-8").splitlines()
    # The added tokens are lines past the vocabulary's: the model's ids, in order.
    (directory / "vocab.txt").write_text("\n".join([*tokens, *added]) + "\n", encoding="utf-8")
    lower_case = str(model.tokenizer.get("type") or "").endswith("LowerCase")
    _settings(
        directory,
        {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": lower_case,
            "strip_accents": None,  # with the lower-casing, as BERT's normaliser does
            "model_max_length": int(model.max_position_embeddings),
        },
        added,
    )
    return {}


def _hf_t5(source: Path, directory: Path, model: Any, added: tuple[str, ...]) -> dict[str, int]:
    """tokenizer.json or spiece.model, and T5Tokenizer's settings; its sentinels are its own."""
    shutil.copy2(
        source, directory / ("tokenizer.json" if source.suffix == ".json" else "spiece.model")
    )
    settings = {
        "tokenizer_class": "T5Tokenizer",
        "extra_ids": sum(1 for token in added if token.startswith("<extra_id_")),
        "model_max_length": int(model.max_position_embeddings),
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return {}


def _hf_json(source: Path, directory: Path, model: Any) -> dict[str, int]:
    """A tokenizer.json (an imported model's), with settings naming its end-of-text token."""
    import tokenizers

    shutil.copy2(source, directory / "tokenizer.json")
    eod = model.tokenizer.get("eod_token")
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(model.max_position_embeddings),
        **({"eos_token": eod} if eod else {}),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    token = tokenizers.Tokenizer.from_file(str(source)).token_to_id(eod) if eod else None
    return {} if token is None else {"eos_token_id": token}


def _sentencepiece(
    source: Path, directory: Path, model: Any, added: tuple[str, ...] = ()
) -> dict[str, int]:
    import sentencepiece

    shutil.copy2(source, directory / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(source))

    def piece(index: int) -> str | None:
        return processor.id_to_piece(index) if 0 <= index < processor.get_piece_size() else None

    # Documents are tokenized without BOS/EOS in data preparation (EOD is appended as a
    # separate id), so the Hugging Face tokenizer must not add them either. `legacy` keeps
    # SentencePiece's own handling of the leading space.
    _settings(
        directory,
        {
            "tokenizer_class": "LlamaTokenizer",
            "add_bos_token": False,
            "add_eos_token": False,
            "legacy": True,
            "model_max_length": int(model.max_position_embeddings),
            "unk_token": piece(processor.unk_id()),
            "bos_token": piece(processor.bos_id()),
            "eos_token": piece(processor.eos_id()),
            "pad_token": piece(processor.pad_id()),
        },
        added,
    )
    ids = {"bos_token_id": processor.bos_id(), "eos_token_id": processor.eos_id()}
    return {name: value for name, value in ids.items() if value >= 0}


def _gpt2(vocab: Path, merges: Path, directory: Path, model: Any) -> dict[str, int]:
    shutil.copy2(vocab, directory / "vocab.json")
    shutil.copy2(merges, directory / "merges.txt")
    end = "<|endoftext|>"
    _settings(
        directory,
        {
            "tokenizer_class": "GPT2Tokenizer",
            "model_max_length": int(model.max_position_embeddings),
            "bos_token": end,
            "eos_token": end,
            "unk_token": end,
        },
        (),
    )
    table = json.loads(vocab.read_text())
    return {"bos_token_id": table[end], "eos_token_id": table[end]} if end in table else {}
