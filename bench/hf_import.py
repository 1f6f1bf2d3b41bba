"""Benchmark the Hugging Face import's memory and time on a Llama-shaped model of a few GB.

    python3 bench/hf_import.py [--layers 24] [--hidden 2048] [--workdir DIR]

In one run it
  1. writes a Llama 3 style checkpoint made here (random bf16 weights, GQA, untied output
     layer, rope scaling; config.json, two safetensors shards with their index, a byte-level
     BPE tokenizer trained on the shipped corpus): about 2.5 GB with the defaults;
  2. imports it as a user does, `python3 main.py stages=[conversion] conversion=hf_import`,
     and records the peak resident memory (the largest process: the import job) and the time;
  3. measures two references in fresh processes: the same interpreter with torch imported
     holding the checkpoint's largest tensor (what streaming should come close to), and
     safetensors' own `load_file` of every shard (what a load-it-all import needs); and the
     time to copy the shards (the disk's share of an import);
  4. checks that the portable file holds every weight of the checkpoint (same bytes),
then prints a table and the ratios "import peak / one-tensor process" (target <= 2) and
"import time / copy time".

Peak memory is each process's own ru_maxrss (with the descendants it waited for), from
os.wait4, so the numbers are the kernel's, not sampled; this process imports no torch and
holds nothing large, since a child's count starts from the pages of the process it forked
from. Run it on an idle machine: the times, not the memory, move with load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = 2.0  # a few tensors at once (a layer's pieces, the table and its copy), not the model
VOCAB = 32768  # the checkpoint's rows; the tokenizer's are fewer, as in real checkpoints


def llama_config(layers: int, hidden: int) -> dict:
    heads = hidden // 128
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": int(hidden * 2.75) // 256 * 256,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 4),
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden)}
    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}"
        shapes |= {
            f"{at}.input_layernorm.weight": (hidden,),
            f"{at}.self_attn.q_proj.weight": (hidden, hidden),
            f"{at}.self_attn.k_proj.weight": (kv, hidden),
            f"{at}.self_attn.v_proj.weight": (kv, hidden),
            f"{at}.self_attn.o_proj.weight": (hidden, hidden),
            f"{at}.post_attention_layernorm.weight": (hidden,),
            f"{at}.mlp.gate_proj.weight": (ffn, hidden),
            f"{at}.mlp.up_proj.weight": (ffn, hidden),
            f"{at}.mlp.down_proj.weight": (hidden, ffn),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (VOCAB, hidden)}
    return shapes


def write_checkpoint(folder: Path, layers: int, hidden: int) -> tuple[int, int]:
    """The checkpoint in two shards; (its bytes, its largest tensor's bytes)."""
    import torch

    from launcher_scripts.formats.safetensors_stream import StreamedTensor, write

    config = llama_config(layers, hidden)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = tensor_shapes(config)
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    generator = torch.Generator().manual_seed(0)

    def random(shape: tuple[int, ...]) -> tuple[torch.Tensor]:
        return ((0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16),)

    weight_map, total = {}, 0
    for number, half in enumerate(halves, start=1):
        shard = f"model-{number:05d}-of-00002.safetensors"
        tensors = [
            StreamedTensor(name, shapes[name], torch.bfloat16, lambda s=shapes[name]: random(s))
            for name in half
        ]
        total += write(folder / shard, tensors, {"format": "pt"})
        weight_map |= {name: shard for name in half}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    write_tokenizer(folder)
    largest = max(2 * size[0] * (size[1] if len(size) > 1 else 1) for size in shapes.values())
    return total, largest


def write_tokenizer(folder: Path) -> None:
    import gzip

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = REPO / "launcher_scripts" / "sample_data" / "tiny_corpus.jsonl.gz"
    with gzip.open(corpus, "rt") as lines:
        texts = [json.loads(line)["text"] for line in lines]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=["<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|end_of_text|>", bos_token="<|end_of_text|>"
    )
    fast.save_pretrained(folder)


def measured(argv: list[str], cwd: Path = REPO) -> tuple[float, int]:
    """(seconds, peak resident bytes) of a command and the descendants it waited for."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output = process.stdout.read() if process.stdout else b""
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"bench: {' '.join(argv[:4])} failed:\n{output.decode()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024


ONE_TENSOR = """
import sys, torch
from launcher_scripts.formats.safetensors_stream import TensorSource
source = TensorSource(__import__("pathlib").Path(sys.argv[1]))
tensor = source.read(sys.argv[2])
print(tensor.shape)
"""

LOAD_ALL = """
import sys, pathlib, torch
from safetensors.torch import load_file
tensors = {}
for shard in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):
    # load_file maps the file: copies, as a reader that holds the model has them
    tensors |= {name: t.clone() for name, t in load_file(shard).items()}
print(sum(t.numel() for t in tensors.values()))
"""

SAME_BYTES = """
import sys, pathlib, tarfile, torch
from launcher_scripts.formats.safetensors_stream import TensorSource
from launcher_scripts.formats import portable
source = TensorSource(pathlib.Path(sys.argv[1]))
loaded = portable.read(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
hf = sum(source.read(name).numel() for name in source.names)
ours = sum(t.numel() for t in loaded.tensors.values())
print("values", hf, ours)
assert hf == ours, (hf, ours)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:  # in a process of its own: see below
        print(json.dumps(write_checkpoint(args.write_checkpoint, args.layers, args.hidden)))
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-hf-import-"))
    model = work / "Llama-bench"
    results = work / "results"
    shutil.rmtree(model, ignore_errors=True)
    shutil.rmtree(results, ignore_errors=True)
    print(f"writing a Llama-shaped checkpoint under {model} ...", flush=True)
    # Written by a child process: a child's peak memory counts the pages of the process it
    # was forked from, so this one stays small (no torch here).
    writer = subprocess.run(
        [sys.executable, __file__, "--layers", str(args.layers), "--hidden", str(args.hidden),
         "--write-checkpoint", str(model)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    size, largest = json.loads(writer.stdout.splitlines()[-1])
    config = json.loads((model / "config.json").read_text())
    largest_name = "model.embed_tokens.weight"

    import_s, import_rss = measured(
        [sys.executable, str(REPO / "main.py"), "stages=[conversion]", "conversion=hf_import",
         f"conversion.hf_model_dir={model}", f"base_results_dir={results}"]
    )  # fmt: skip
    output = results / model.name / "convert_nemo" / "model.nemo"
    one_s, one_rss = measured([sys.executable, "-c", ONE_TENSOR, str(model), largest_name])
    all_s, all_rss = measured([sys.executable, "-c", LOAD_ALL, str(model)])
    copy = work / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    copy_s, _ = measured(["cp", "-r", str(model), str(copy)])
    shutil.rmtree(copy)
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        measured([sys.executable, "-c", SAME_BYTES, str(model), str(output), scratch])

    gb = 1e9
    print()
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    print(f"checkpoint: {layers} layers, hidden {hidden}, {size / gb:.2f} GB bf16 in 2 shards; "
          f"largest tensor {largest / 1e6:.0f} MB")  # fmt: skip
    print(f"{'':34s} {'seconds':>8s} {'peak RSS GB':>12s}")
    rows = [
        ("import (main.py, job included)", import_s, import_rss),
        ("torch + the largest tensor", one_s, one_rss),
        ("safetensors load_file, all shards", all_s, all_rss),
        ("cp -r of the checkpoint", copy_s, None),
    ]
    for label, seconds, rss in rows:
        print(f"{label:34s} {seconds:8.1f} {'' if rss is None else f'{rss / gb:12.2f}'}")
    print(f"portable file: {output.stat().st_size / gb:.2f} GB, every value there")
    ratio = import_rss / one_rss
    print(f"\nimport peak / one-tensor process: {ratio:.2f} (target <= {TARGET}); "
          f"import peak / model size: {import_rss / size:.2f}; "
          f"import time / copy time: {import_s / copy_s:.1f}")  # fmt: skip
    print(f"load average: {os.getloadavg()[0]:.2f}")
    if not args.workdir:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
