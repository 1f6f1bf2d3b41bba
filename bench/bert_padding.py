"""How much of a BERT batch is padding: the most that LDDL's sequence-length binning could save.

    python3 bench/bert_padding.py [--data-dir DIR] [--seq-length 128] [--samples 4000] [--bin 64]

NVIDIA's LDDL (the reference's 5.1.2.4.4) bins BERT samples by length so that a batch is padded
to its bin, not to seq_length. Megatron's BERT samples (megatron-core's
BERTMaskedWordPieceDataset, which the training job reads) are already packed: sentences of one
document are added until the target length, and only `short_seq_prob` of the samples aim shorter.
So binning can save at most the padding this prints, measured on the training job's own samples:

- the padding fraction at seq_length;
- the ideal speed-up of binning by --bin tokens, for work linear in the length (the MLPs, most
  of BERT's FLOPs) and quadratic in it (attention scores): padded work / binned work.

Default data: the shipped corpus prepared for BERT with the tests' WordPiece vocabulary (as the
tests' fixture does), in a temporary folder. --data-dir: a data_dir already prepared for
bert/tiny's data_prefix (my-bert_00_text_sentence under custom_dataset/preprocessed).
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = REPO / "tests" / "data" / "wordpiece_vocab.txt"


def prepare(root: Path) -> Path:
    vocab = root / "data" / "custom_dataset" / "bpe" / "custom_sp_tokenizer.vocab.txt"
    vocab.parent.mkdir(parents=True)
    shutil.copyfile(VOCAB, vocab)
    command = [sys.executable, str(REPO / "main.py"), "stages=[data_preparation]"]
    command += [f"data_dir={root}/data", f"base_results_dir={root}/results"]
    command += ["data_preparation.train_tokenizer=false", f"data_preparation.vocab_file={vocab}"]
    command += ["data_preparation.split_sentences=true", "data_preparation.lower_case=true"]
    subprocess.run(command, check=True, capture_output=True)
    return root / "data"


def sample_lengths(data_dir: Path, seq_length: int, samples: int, cache: Path) -> list[int]:
    """The real tokens of the first `samples` training samples of bert/tiny's recipe."""
    import torch.distributed as dist

    from launcher_scripts.config.compose import compose_config
    from launcher_scripts.config.preflight import resolve
    from launcher_scripts.families import family_of
    from launcher_scripts.jobs.models import runtime_of
    from launcher_scripts.ports import free_port

    if not dist.is_initialized():  # megatron-core's dataset builder asks the rank
        address = f"tcp://127.0.0.1:{free_port()}"
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=address)
    overrides = ["stages=[training]", "training=bert/tiny", f"data_dir={data_dir}"]
    overrides.append(f"training.model.data.seq_length={seq_length}")
    overrides.append(f"training.model.max_position_embeddings={seq_length}")
    cfg = resolve(compose_config(overrides), ["training"]).training
    runtime = runtime_of(family_of(cfg, "training"))
    vocab = runtime.data_tokenizer(cfg)
    train, _, _ = runtime.build_datasets(cfg, vocab, (samples, 1, 0), cache)
    return [int(train[i]["padding_mask"].sum()) for i in range(samples)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--bin", type=int, default=64, help="bin width in tokens (LDDL's: 64)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = args.data_dir or prepare(Path(scratch))
        lengths = sample_lengths(data_dir, args.seq_length, args.samples, Path(scratch) / "index")
    full = args.seq_length
    binned = [min(full, math.ceil(n / args.bin) * args.bin) for n in lengths]
    padding = 1 - sum(lengths) / (full * len(lengths))
    linear = full * len(lengths) / sum(binned)
    quadratic = full**2 * len(lengths) / sum(b * b for b in binned)
    short = sum(n < full - args.bin for n in lengths) / len(lengths)
    mean = sum(lengths) / len(lengths)
    print(f"samples {len(lengths)} at seq_length {full}: mean real tokens {mean:.1f}")
    print(f"padding fraction {padding:.4f}; samples shorter than seq_length - bin: {short:.4f}")
    speed_up = f"linear {linear:.4f}, quadratic {quadratic:.4f}"
    print(f"ideal binning speed-up (bins of {args.bin}): {speed_up}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
