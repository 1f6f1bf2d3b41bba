"""recipes/restore.py: what a continued pretraining recipe may state about the file it starts
from. The values the runtime fills in count as stated (no query groups: one per head; no head
size: hidden / heads; 500000 and 500000.0 are one rope base), and a difference is one error
naming the recipe's key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from launcher_scripts.errors import ConfigError
from launcher_scripts.recipes.restore import check_architecture, check_rows, restored_model

FILE = OmegaConf.create(
    {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "kv_channels": 16,
        "rotary_base": 500000.0,
        "normalization": "rmsnorm",
        "tokenizer": {"library": "huggingface", "model": "/x/tokenizer.json"},
    }
)


def test_what_the_runtime_fills_in_counts_as_stated() -> None:
    recipe = OmegaConf.create(
        {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": None,
            "kv_channels": None,
            "rotary_base": 500000,
        }
    )
    check_architecture(recipe, FILE, "training", "the file")


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_layers", 3), ("num_query_groups", 2), ("normalization", "layernorm"), ("bias", False)],
)
def test_a_difference_names_the_recipe_key(key: str, value: object) -> None:
    recipe = OmegaConf.create({"hidden_size": 64, "num_attention_heads": 4, key: value})
    with pytest.raises(ConfigError) as raised:
        check_architecture(recipe, FILE, "training", "the file")
    assert str(raised.value).startswith(f"training.model.{key}:"), raised.value


def test_the_rows_must_be_the_stated_ones_and_split_over_tp() -> None:
    with pytest.raises(ConfigError, match=r"^training\.model\.padded_vocab_size:"):
        check_rows(OmegaConf.create({"padded_vocab_size": 100}), 96, "training", "the file")
    with pytest.raises(ConfigError, match=r"^training\.model\.tensor_model_parallel_size:"):
        check_rows(OmegaConf.create({"tensor_model_parallel_size": 5}), 96, "training", "f")


def test_the_job_builds_the_file_model_with_the_recipe_layout() -> None:
    recipe = OmegaConf.create(
        {"hidden_size": 64, "num_attention_heads": 4, "tensor_model_parallel_size": 2,
         "tokenizer": {"library": "sentencepiece", "model": "/y/sp.model"}}
    )  # fmt: skip
    model = restored_model(recipe, FILE, 96, "training")
    assert model.num_layers == 2 and model.tensor_model_parallel_size == 2
    assert model.tokenizer.model == "/x/tokenizer.json"
    assert model.padded_vocab_size == 96 and model.make_vocab_size_divisible_by == 1
