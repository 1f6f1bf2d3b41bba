"""Conversion: a training run's checkpoint to the portable file and Hugging Face, and the
comparisons of our outputs with transformers'."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support import REPO
from tests.support.commands import ONE_THREAD, one_error_line, run_main


def hf_imported(hf_dir: Path, results: Path, *overrides: str) -> Path:
    """`conversion=hf_import` of a Hugging Face directory through main.py (with the recipe's
    `overrides`): the portable file, results/<directory name>/convert_nemo/model.nemo."""
    result = run_main(
        "stages=[conversion]",
        "conversion=hf_import",
        f"conversion.hf_model_dir={hf_dir}",
        f"base_results_dir={results}",
        *overrides,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return results / hf_dir.name / "convert_nemo" / "model.nemo"


def assert_import_refused(hf_dir: Path, results: Path, *fragments: str) -> None:
    """`conversion=hf_import` of `hf_dir` is refused in preflight: one line naming
    conversion.hf_model_dir and each fragment, no traceback, nothing written under `results`."""
    result = run_main(
        "stages=[conversion]",
        "conversion=hf_import",
        f"conversion.hf_model_dir={hf_dir}",
        f"base_results_dir={results}",
    )
    one_error_line(result, "conversion.hf_model_dir", *fragments)
    assert "Traceback" not in result.stderr
    assert not results.exists()


def run_conversion_job(
    overrides: list[str], config: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    """The conversion job as the launcher starts it, on the recipe `overrides` compose (its
    resolved section written to `config`)."""
    from omegaconf import OmegaConf

    from launcher_scripts.config.compose import compose_config

    cfg = compose_config(overrides)
    config.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(OmegaConf.to_container(cfg.conversion, resolve=True)), config)
    return subprocess.run(
        [sys.executable, "-m", "launcher_scripts.jobs.conversion.convert", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=timeout,
    )


def convert(prepared: Path, run: Path, output: Path, *overrides: str) -> Path:
    """Run the conversion job on `run`'s checkpoint; returns the portable file."""
    from omegaconf import OmegaConf

    args = [
        f"data_dir={prepared}/data",
        f"base_results_dir={prepared}/results",
        f"conversion.model.checkpoint_folder={run}/checkpoints",
        f"conversion.model.hparams_file={run}/hparams.yaml",
        f"conversion.run.output_path={output}",
        *overrides,
    ]
    config = output.parent / f"{output.name}.yaml"
    result = run_conversion_job(args, config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return output / str(OmegaConf.load(config).run.nemo_file_name)


def assert_same_outputs(
    expected: dict[str, Any], computed: dict[str, Any], inputs: dict[str, Any]
) -> None:
    """Our outputs and transformers' agree to 1e-4, logits where the query is a token, not
    padding (id 0; megatron-core's masks give padded queries a uniform attention, transformers
    does not)."""
    import torch

    assert expected.keys() == computed.keys()
    queries = next(inputs[k] for k in ("tokens", "text_dec", "text") if k in inputs) != 0
    for name, value in expected.items():
        gap = (value - computed[name]).abs()
        if name == "logits":
            gap = gap * queries.unsqueeze(-1)
        worst = gap.max().item()
        # The position and the scale make a rare failure (seen in CI) diagnosable.
        where = tuple(int(i) for i in torch.nonzero(gap == gap.max())[0])
        scale = value.abs().max().item()
        assert worst <= 1e-4, f"{name}: max |ours - theirs| {worst} at {where}; max {scale}"


def hf_computes_our_logits_each(
    cases: Sequence[tuple[Path, Path, dict[str, Any], str]],
    folder: Path,
    reshard: tuple[Path, Path, tuple[tuple[int, int], ...]] | None = None,
) -> list[dict[str, Any]]:
    """For each (model file, HF dir, inputs, architecture) case: transformers loads the HF dir
    as the architecture and computes the outputs our model built from the model file computes
    on the inputs, to 1e-4 in fp32 (assert_same_outputs). Two fresh processes for all the
    cases: our models' outputs in one (tests/scripts/portable_logits.py), transformers' in the
    other (tests/scripts/hf_logits.py). Returns transformers' outputs, in the cases' order.

    With `reshard` (model file, run, layouts), also assert_reshards_exactly(*reshard), and our
    outputs are computed at the end of that launch (tests/scripts/reshard_check.py --logits)
    instead of in a process of their own."""
    import torch

    ours_args: list[str] = []
    theirs_args: list[str] = []
    for at, (model_file, hf_dir, inputs, _) in enumerate(cases):
        torch.save(inputs, folder / f"inputs{at}.pt")
        ours_args += [str(model_file), str(folder / f"inputs{at}.pt"), str(folder / f"ours{at}.pt")]
        theirs_args += [str(hf_dir), str(folder / f"inputs{at}.pt"), str(folder / f"hf{at}.pt")]
    if reshard is None:
        ours = _run_script("portable_logits", ours_args)
        assert ours.returncode == 0, ours.stderr[-3000:]
    else:
        reshard_checks(reshard, extra=["--logits", *ours_args])
    theirs = _run_script("hf_logits", theirs_args)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    assert theirs.stdout.split()[-len(cases) :] == [case[3] for case in cases], theirs.stdout
    results = []
    for at, (_, _, inputs, _) in enumerate(cases):
        computed = torch.load(folder / f"hf{at}.pt")
        assert_same_outputs(torch.load(folder / f"ours{at}.pt"), computed, inputs)
        results.append(computed)
    return results


def _run_script(script: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"tests.scripts.{script}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=300,
    )


def assert_reshards_exactly(
    model_file: Path, run: Path, layouts: tuple[tuple[int, int], ...]
) -> None:
    """The portable file built at each (TP, PP) equals, bit for bit, the model loaded from the
    run's training checkpoint at that layout (tests/scripts/reshard_check.py, one launch)."""
    reshard_checks((model_file, run, layouts))


def reshard_checks(
    *groups: tuple[Path, Path, tuple[tuple[int, int], ...]], extra: Sequence[str] = ()
) -> None:
    """assert_reshards_exactly for several (portable file, run, layouts) in one launch of
    tests/scripts/reshard_check.py; `extra` ends its command line (its --logits)."""
    processes = max(t * p for _, _, layouts in groups for t, p in layouts)
    arguments: list[str] = []
    for model_file, run, layouts in groups:
        checkpoints = (run / "checkpoints").iterdir()
        checkpoint = next(p for p in checkpoints if p.name.startswith("megatron"))
        arguments += ["--"] if arguments else []
        arguments += [str(model_file), str(checkpoint), *(f"{t}x{p}" for t, p in layouts)]
    check = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            f"--nproc-per-node={processes}",
            *("-m", "tests.scripts.reshard_check", *arguments, *extra),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=600,
    )
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    lines = check.stdout.splitlines()
    for number, (_, _, layouts) in enumerate(groups):
        for tensor, pipeline in layouts:
            layout = f"{number}: {tensor}x{pipeline} rank "
            assert sum(line.startswith(layout) for line in lines) == processes, check.stdout
        group = sum(line.startswith(f"{number}: ") for line in lines)
        assert group == processes * len(layouts), check.stdout
    assert check.stdout.count(" 0 mismatched") == processes * sum(
        len(layouts) for _, _, layouts in groups
    ), check.stdout


def assert_padded_and_unpadded_exactly(
    model_file: Path, hf_dir: Path, tensor: int, divisor: int, rows: int, tables: dict[str, str]
) -> None:
    """The portable file of an import at TP `tensor` and make_vocab_size_divisible_by
    `divisor` holds `rows` rows in each table with a row per vocabulary entry: the
    checkpoint's rows as they are (`tables`: ours -> the checkpoint's), then copies of the last
    one, as Megatron pads them; it records the checkpoint's count, and the export's tensors
    (hf_common.unpadded_vocabulary) are the checkpoint's exactly."""
    import tarfile

    import torch
    from safetensors.torch import load, load_file

    from launcher_scripts.formats import portable
    from launcher_scripts.jobs.models.hf_common import VOCAB_TABLES, unpadded_vocabulary

    config = portable.read_config(model_file)
    original = load_file(hf_dir / "model.safetensors")
    with tarfile.open(model_file) as tar:
        member = tar.extractfile(portable.WEIGHTS)
        assert member is not None
        ours = load(member.read())
    held = original[next(iter(tables.values()))].shape[0]
    assert config[portable.HF_VOCAB_SIZE] == held, config
    assert config.tensor_model_parallel_size == tensor, config
    assert rows % (tensor * divisor) == 0 and 0 < rows - held < tensor * divisor, (rows, held)
    assert {name: ours[name].shape[0] for name in VOCAB_TABLES if name in ours} == dict.fromkeys(
        (name for name in VOCAB_TABLES if name in ours), rows
    )
    for name, theirs in tables.items():
        table = ours[name]
        assert torch.equal(table[:held], original[theirs]), name
        last_and_padding = table[held - 1 :]
        assert torch.equal(last_and_padding, table[held - 1].expand_as(last_and_padding)), name
    back = unpadded_vocabulary(config, ours)
    for name, theirs in tables.items():
        assert torch.equal(back[name], original[theirs]), name


def checks(*cases: tuple[Path, Path, str | Path, int | str, int]) -> list[dict]:
    """tests/scripts/hf_gpt_check.py on each (model, HF dir, export dir, TP or "TP:EP", PP),
    one launch: under torchrun when a case takes more than one process."""

    def processes_of(tensor: int | str, pipeline: int) -> int:
        size, _, expert = str(tensor).partition(":")
        return int(size) * int(expert or 1) * pipeline

    processes = max(processes_of(tensor, pipeline) for *_, tensor, pipeline in cases)
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += [f"--nproc-per-node={processes}"]
    arguments = [str(value) for case in cases for value in case]
    result = subprocess.run(
        [*launcher, "-m", "tests.scripts.hf_gpt_check", *arguments],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ONE_THREAD,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [
        json.JSONDecoder().raw_decode(line, line.index("report: ") + 8)[0]
        for line in result.stdout.splitlines()
        if "report: " in line
    ]
    assert len(reports) == len(cases), result.stdout[-3000:]
    return reports


def architecture_overrides(model: Path) -> list[str]:
    """training.model.<key>=<value> for the imported file's architecture: a shipped recipe
    states the published model's, and the tiny one must be stated to train from it."""
    from launcher_scripts.formats.portable_check import inspect_portable
    from launcher_scripts.recipes.restore import ARCHITECTURE_DEFAULTS

    summary = inspect_portable(model)
    rows = summary.shapes["embedding.word_embeddings.weight"][0]
    stated = [
        f"training.model.{name}={summary.config[name]}"
        for name in ARCHITECTURE_DEFAULTS
        if summary.config.get(name) is not None
    ]
    return [*stated, f"training.model.padded_vocab_size={rows}"]


def continued_on_cpu(data: Path) -> list[str]:
    """A continued pretraining run's overrides for two CPU processes (add the layout): two
    steps on 8-token samples of `data`/corpus_text_document, at a learning rate of 1e-12 (steps
    far below the weights' spacing, not 0), validated once."""
    return [
        f"training.model.data.data_prefix=[1.0,{data}/corpus_text_document]",
        'training.model.data.splits_string="50,50,0"',
        "training.model.encoder_seq_length=8",
        "training.model.activations_checkpoint_granularity=null",
        "training.model.global_batch_size=2",
        "training.model.micro_batch_size=1",
        "training.model.data.num_workers=0",
        "training.model.transformer_engine=False",
        "training.model.optim.lr=1e-12",
        "training.model.optim.sched.min_lr=1e-13",
        "training.model.optim.sched.warmup_steps=1",
        "training.trainer.accelerator=cpu",
        "training.trainer.precision=32",
        "training.trainer.num_nodes=1",
        "training.trainer.devices=2",
        "training.trainer.max_steps=2",
        "training.trainer.val_check_interval=2",
        "training.trainer.limit_val_batches=1",
        "training.trainer.log_every_n_steps=1",
    ]


def prepared_with(tokenizer: Path, corpus: Path, data: Path) -> list[str]:
    """The data preparation's overrides: `corpus` tokenized with a model's own tokenizer into
    `data`."""
    return [
        "data_preparation=generic/custom_dataset",
        "data_preparation.train_tokenizer=false",
        f"data_preparation.tokenizer_model={tokenizer}",
        f"data_preparation.raw_dataset_files=[{corpus}]",
        f"data_preparation.preprocessed_dir={data}",
        "data_preparation.run.node_array_size=1",
    ]
