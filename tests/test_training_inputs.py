"""What a training recipe reads, checked before anything runs: T5's span corruption has room
for its sentinels and its decoder, the tokenizer section means one tokenizer, the default data
preparation writes what the run's training recipe reads, and data tokenized with another
tokenizer than the recipe's is refused naming both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from launcher_scripts import pipeline
from launcher_scripts.errors import ConfigError
from tests.support.commands import assert_one_line_error, one_error_line, run_main
from tests.support.session_builds import WORDPIECE_VOCAB


def dry_plan(tmp_path: Path, *overrides: str) -> list[pipeline.PlannedStage]:
    args = [f"base_results_dir={tmp_path}/results", f"data_dir={tmp_path}/data", "dry_run=true"]
    return pipeline.plan(pipeline.compose([*args, *overrides]))[2]


def refused(tmp_path: Path, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as error:
        dry_plan(tmp_path, *overrides)
    return error.value


# ----- T5's span corruption ------------------------------------------------------------------

# (settings, key, the least value it takes): t5/tiny's seq_length 128 leaves 126 tokens, of
# which masked_lm_prob 0.15 masks at most 18; each span needs a sentinel, the decoder a start
# token, the masked tokens and a sentinel per span (at least one span when whole words of any
# length are masked, 18 / max_ngram_size rounded up otherwise).
SPAN_ROOM = [
    ((), "tokenizer.num_sentinel_tokens", 18),
    ((), "data.seq_length_dec", 20),
    (("data.whole_word_masking=false", "data.max_ngram_size=1"), "data.seq_length_dec", 37),
    (("data.whole_word_masking=false", "data.max_ngram_size=3"), "data.seq_length_dec", 25),
    (("data.masked_lm_prob=0.3",), "tokenizer.num_sentinel_tokens", 37),
    (("seq_length=512", "data.seq_length_dec=128"), "tokenizer.num_sentinel_tokens", 76),
    (("seq_length=512",), "data.seq_length_dec", 78),
]


@pytest.mark.parametrize(("settings", "name", "least"), SPAN_ROOM)
def test_t5_span_corruption_needs_room_for_its_sentinels_and_decoder(
    settings: tuple[str, ...], name: str, least: int, tmp_path: Path
) -> None:
    """One less than the least is refused naming it (megatron-core's dataset would fail on an
    IndexError or an AssertionError at some sample); the least itself is accepted."""
    base = ["stages=[training]", "training=t5/tiny", *(f"training.model.{s}" for s in settings)]
    error = refused(tmp_path, *base, f"training.model.{name}={least - 1}")
    assert error.key == f"training.model.{name}", str(error)
    assert f"at least {least}" in error.fix, str(error)
    dry_plan(tmp_path, *base, f"training.model.{name}={least}")


@pytest.mark.parametrize("recipe", ["t5/220m", "t5/3b", "mt5/170m", "mt5/tiny", "t5/tiny"])
def test_published_t5_recipes_have_room_for_span_corruption(recipe: str, tmp_path: Path) -> None:
    one_node = "training.trainer.num_nodes=1"  # the local backend runs one machine's processes
    dry_plan(tmp_path, "stages=[training]", f"training={recipe}", one_node)


@pytest.mark.slow  # starts the training job
def test_a_sample_too_long_for_the_decoder_is_one_line_from_the_job(
    prepared_wordpiece: Path, tmp_path: Path
) -> None:
    """A decoder that holds every full sample's masked tokens but not that many one-word spans
    (max_ngram_size 1): preflight lets it through, and the job names the key and the length
    that holds any sample at the first such sample, not megatron-core's bare assertion."""
    result = run_main(
        "stages=[training]", "training=t5/tiny", f"data_dir={prepared_wordpiece}/data",
        f"base_results_dir={tmp_path}", "training.trainer.max_steps=2",
        "training.model.data.max_ngram_size=1", "training.model.data.seq_length_dec=20",
    )  # fmt: skip
    one_error_line(result, "stage training, job t5_tiny failed")
    [log] = (tmp_path / "t5_tiny").glob("log-t5_tiny_*.out")
    errors = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    [error] = errors
    assert error.startswith(
        "error: training.model.data.seq_length_dec: 20 does not hold the decoder input of sample "
    ), error
    assert error.endswith("set it to 37, which holds any sample"), error
    assert "Traceback" not in log.read_text()


# ----- the tokenizer section -----------------------------------------------------------------

TINY_RECIPES = ["gpt3/tiny", "t5/tiny", "mt5/tiny", "bert/tiny"]


@pytest.mark.parametrize("recipe", TINY_RECIPES)
@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (("library=sentencepiece", "model=null", "vocab_file=/tok/vocab.txt"),
         "is not set, but tokenizer.library is sentencepiece"),
        (("library=megatron", "type=BertWordPieceLowerCase", "model=/tok/spm.model",
          "vocab_file=/tok/vocab.txt"),
         "is /tok/spm.model, but tokenizer.library is megatron"),
    ],
    ids=["sentencepiece-without-model", "megatron-with-model"],
)  # fmt: skip
def test_a_tokenizer_library_its_files_contradict_is_refused(
    recipe: str, overrides: tuple[str, ...], problem: str, tmp_path: Path
) -> None:
    """The job reads the files, the export the library: a SentencePiece library with a WordPiece
    vocab trained on WordPiece ids and then failed to export (FileNotFoundError: 'None')."""
    error = refused(
        tmp_path,
        "stages=[training]",
        f"training={recipe}",
        *(f"training.model.tokenizer.{o}" for o in overrides),
    )
    assert error.key == "training.model.tokenizer.model", str(error)
    assert problem in error.problem, str(error)


# ----- the default data preparation follows the training recipe ------------------------------

# The preprocess options each tiny recipe's data needs, as the data preparation renders them.
DATA_OPTIONS = {
    "gpt3/tiny": {"--tokenizer-model"},
    "mt5/tiny": {"--tokenizer-model", "--split-sentences", "--no-append-eod"},
    "t5/tiny": {"--vocab-file", "--split-sentences", "--no-append-eod", "--lower-case"},
    "bert/tiny": {"--vocab-file", "--split-sentences", "--no-append-eod", "--lower-case"},
}
OPTIONS = {"--tokenizer-model", "--vocab-file", "--split-sentences", "--no-append-eod",
           "--lower-case"}  # fmt: skip


def preprocess_options(planned: list[pipeline.PlannedStage]) -> set[str]:
    [stage] = [s for s in planned if s.stage == "data_preparation"]
    [job] = [j for j in stage.jobs if j.spec.name.endswith("-preprocess")]
    return OPTIONS & set(job.spec.commands[0].args)


@pytest.mark.parametrize("recipe", TINY_RECIPES)
def test_the_default_data_preparation_writes_what_the_training_recipe_reads(
    recipe: str, tmp_path: Path
) -> None:
    """`stages=[data_preparation,training] training=<family>/tiny` alone: the data preparation
    trains the recipe's kind of tokenizer where the recipe reads it and writes the data it
    reads (sentences for BERT and T5), so nothing is left for the training to miss."""
    planned = dry_plan(tmp_path, "stages=[data_preparation,training]", f"training={recipe}")
    assert preprocess_options(planned) == DATA_OPTIONS[recipe]
    for stage in planned:
        assert stage.missing_inputs == (), (stage.stage, stage.missing_inputs)


@pytest.mark.parametrize("recipe", TINY_RECIPES)
def test_data_preparation_alone_follows_the_training_recipe_it_names(
    recipe: str, tmp_path: Path
) -> None:
    planned = dry_plan(tmp_path, "stages=[data_preparation]", f"training={recipe}")
    assert preprocess_options(planned) == DATA_OPTIONS[recipe]


def test_the_data_preparations_own_values_win(tmp_path: Path) -> None:
    planned = dry_plan(
        tmp_path,
        "stages=[data_preparation]",
        "training=t5/tiny",
        "data_preparation.split_sentences=false",
        "data_preparation.lower_case=false",
        "data_preparation.append_eod=true",
    )
    assert preprocess_options(planned) == {"--vocab-file"}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["t5/tiny", "bert/tiny"])
def test_encoder_tiny_recipes_prepare_their_data_and_train_with_no_data_flags(
    recipe: str, tmp_path: Path
) -> None:
    """docs/training.md's commands for T5 and BERT without the data_preparation flags they
    once needed (a few steps each)."""
    result = run_main(
        "stages=[data_preparation,training]", f"training={recipe}", f"data_dir={tmp_path}/data",
        f"base_results_dir={tmp_path}/results", "training.trainer.max_steps=4",
        "training.trainer.val_check_interval=4", "training.trainer.log_every_n_steps=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all stages completed" in result.stdout
    assert (tmp_path / "data/custom_dataset/preprocessed/tiny_corpus_text_sentence.idx").is_file()


# ----- data tokenized with another tokenizer ---------------------------------------------------


def sentencepiece_model(prepared: Path) -> Path:
    return prepared / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.model"


def shards(prepared: Path, level: str) -> str:
    return str(prepared / "data" / "custom_dataset" / "preprocessed" / f"tiny_corpus_text_{level}")


@pytest.mark.parametrize("recipe", ["t5/tiny", "bert/tiny"])
def test_encoder_recipes_refuse_data_of_gpts_sentencepiece_model(
    recipe: str, prepared: Path, tmp_path: Path
) -> None:
    """The shards record their tokenizer's hash: the WordPiece recipe is not it."""
    result = run_main(
        "stages=[training]", f"training={recipe}", "dry_run=true",
        f"base_results_dir={tmp_path}", f"training.model.tokenizer.vocab_file={WORDPIECE_VOCAB}",
        f"training.model.data.data_prefix=[1.0,{shards(prepared, 'document')}]",
    )  # fmt: skip
    assert_one_line_error(
        result,
        f"error: training.model.tokenizer.vocab_file: the recipe's tokenizer (vocab_file "
        f"{WORDPIECE_VOCAB} (sha256 ",
        f"training.model.data.data_prefix {shards(prepared, 'document')} was tokenized with "
        f"(model {sentencepiece_model(prepared)} (sha256 ",
    )


@pytest.mark.parametrize("recipe", ["gpt3/tiny", "mt5/tiny"])
def test_sentencepiece_recipes_refuse_wordpiece_data(
    recipe: str, prepared: Path, prepared_wordpiece: Path, tmp_path: Path
) -> None:
    """WordPiece ids (2000 of them) fit the SentencePiece model's 8000: only the recorded
    tokenizer tells that they are not its ids."""
    result = run_main(
        "stages=[training]", f"training={recipe}", "dry_run=true",
        f"base_results_dir={tmp_path}",
        f"training.model.tokenizer.model={sentencepiece_model(prepared)}",
        f"training.model.data.data_prefix=[1.0,{shards(prepared_wordpiece, 'sentence')}]",
    )  # fmt: skip
    assert_one_line_error(
        result,
        "error: training.model.tokenizer.model: the recipe's tokenizer (model ",
        f"was tokenized with (vocab_file {prepared_wordpiece}/data/custom_dataset/bpe/"
        "custom_sp_tokenizer.vocab.txt (sha256 ",
    )


def test_a_copy_of_the_tokenizer_the_data_was_made_with_is_that_tokenizer(
    prepared_wordpiece: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "elsewhere" / "vocab.txt"
    copy.parent.mkdir()
    shutil.copyfile(WORDPIECE_VOCAB, copy)
    dry_plan(
        tmp_path,
        "stages=[training]",
        "training=t5/tiny",
        f"training.model.tokenizer.vocab_file={copy}",
        f"training.model.data.data_prefix=[1.0,{shards(prepared_wordpiece, 'sentence')}]",
    )


@pytest.mark.parametrize(
    ("recipe", "data_preparation", "recipe_file", "planned_file"),
    [
        ("gpt3/tiny", "train_tokenizer_args.model_type=wordpiece", "model", "vocab_file"),
        ("t5/tiny", "train_tokenizer_args.model_type=bpe", "vocab_file", "model"),
        ("mt5/tiny", "train_tokenizer_args.model_prefix=other", "model", "model"),
    ],
)
def test_data_the_same_run_tokenizes_with_another_tokenizer_is_refused(
    recipe: str, data_preparation: str, recipe_file: str, planned_file: str, tmp_path: Path
) -> None:
    error = refused(
        tmp_path,
        "stages=[data_preparation,training]",
        f"training={recipe}",
        f"data_preparation.{data_preparation}",
    )
    assert error.key == f"training.model.tokenizer.{recipe_file}", str(error)
    assert "is not the one this run's data_preparation tokenizes" in error.problem
    assert f"with ({planned_file} {tmp_path}/data/custom_dataset/bpe/" in error.problem


def test_mt5s_blending_alpha_weights_the_languages_by_their_tokens(tmp_path: Path) -> None:
    """run.blending_alpha (the mT5 recipes'): language i is sampled with probability
    n_i^alpha / sum_j n_j^alpha, n_i its tokens; explicit weights in data_prefix win."""
    import numpy as np
    from omegaconf import OmegaConf

    from launcher_scripts.formats.indexed_writer import write_dataset
    from launcher_scripts.jobs.training.data import blend_weights
    from launcher_scripts.recipes import training as recipe

    big, small = tmp_path / "mc4_en_text_document", tmp_path / "mc4_cs_text_document"
    write_dataset(big, [[1] * 900, [2] * 700], np.uint16)  # 1600 tokens
    write_dataset(small, [[3] * 100], np.uint16)  # 100 tokens

    def weights(alpha: object, prefix: list) -> list[float] | None:
        cfg = OmegaConf.create(
            {"run": {"blending_alpha": alpha}, "model": {"data": {"data_prefix": prefix}}}
        )
        return blend_weights(cfg, recipe.data_blend(cfg))

    paths = [str(big), str(small)]
    half = weights(0.5, paths)
    assert half == pytest.approx([40 / 50, 10 / 50])  # sqrt(1600) = 40, sqrt(100) = 10
    assert weights(0.0, paths) == pytest.approx([0.5, 0.5])
    assert weights(1.0, paths) == pytest.approx([1600 / 1700, 100 / 1700])
    assert weights(None, paths) is None  # megatron-core's: by size
    assert weights(0.5, [0.3, str(big), 0.7, str(small)]) == [0.3, 0.7]
    with pytest.raises(ConfigError, match="run.blending_alpha"):
        weights(1.5, paths)


def test_a_bad_blending_alpha_is_refused_before_the_run(tmp_path: Path) -> None:
    result = run_main(
        f"base_results_dir={tmp_path}/r",
        "stages=[training]",
        "training=mt5/170m",
        "training.trainer.num_nodes=1",
        "training.run.blending_alpha=2",
        "dry_run=true",
    )
    assert_one_line_error(result, "training.run.blending_alpha", "from 0 to 1")


@pytest.mark.parametrize("recipe", ["gpt3/tiny", "t5/tiny", "bert/tiny"])
def test_alibi_is_refused_by_name(recipe: str, tmp_path: Path) -> None:
    """NeMo's changelog lists ALiBi for T5 and GPT; megatron-core has no ALiBi bias."""
    result = run_main(
        f"base_results_dir={tmp_path}/r",
        "stages=[training]",
        f"training={recipe}",
        "training.model.position_embedding_type=alibi",
        "dry_run=true",
    )
    assert_one_line_error(result, "training.model.position_embedding_type", "ALiBi")
