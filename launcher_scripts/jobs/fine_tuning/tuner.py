"""The tuning stages' training task: base weights from a portable checkpoint, PEFT modules
attached and the base frozen, SFT data, exact-match validation, and the outputs. The training
loop (jobs/training/trainer.py) asks it through its public hooks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from launcher_scripts.families import family_of
from launcher_scripts.families.file_family import peft_record
from launcher_scripts.files import write_atomic
from launcher_scripts.formats import portable
from launcher_scripts.formats.portable import Portable
from launcher_scripts.jobs.fine_tuning import peft, peft_file, sft_data
from launcher_scripts.jobs.fine_tuning.answers import exact_match, write_jsonl
from launcher_scripts.jobs.fine_tuning.packing import PackedSamples
from launcher_scripts.jobs.inference.generation import generate
from launcher_scripts.jobs.models.base import TuningSide, runtime_of
from launcher_scripts.jobs.training import checkpointing, data, init_weights
from launcher_scripts.jobs.training.runtime import JobError
from launcher_scripts.jobs.training.trainer import Streams, Trainer, TrainingTask
from launcher_scripts.recipes import answer_metrics
from launcher_scripts.recipes.generation_params import GenerationParams
from launcher_scripts.recipes.tuning import TuningSpec, most_layers

GENERATION_BATCH = 16


class TuningTask(TrainingTask):
    # What the task changes in the base model's section before the model is built.
    model_overrides: dict[str, Any] = {}

    @classmethod
    def sequences_per_example(cls, spec: TuningSpec) -> int:
        """The sequences one example of the recipe's batch sizes is (a pair is two)."""
        del spec
        return 1

    def __init__(self, cfg: Any, spec: TuningSpec, base: Portable) -> None:
        self.spec, self.base = spec, base
        self.stage = spec.stage
        family = family_of(cfg, "training")
        side = runtime_of(family).tuning
        if side is None:
            raise JobError(f"model_family {family.name}: this version has no tuning program")
        self.side: TuningSide = side
        self.tokenizer = side.text_tokenizer(cfg.model)
        self.attached: peft.Attached | None = None
        self.valid_records: list[sft_data.Record] = []
        self.seq_length = int(cfg.model.data.seq_length)
        self._check_log_dir(cfg)

    # ----- model ------------------------------------------------------------------------

    def reshape(self, trainer: Trainer, chunks: list[Any]) -> None:
        """Changes to the base model's modules before any weight is loaded (a reward model's
        head); their tensors are `own_key`s."""
        del trainer, chunks

    def own_key(self, key: str) -> bool:
        """Whether a checkpoint tensor is the task's own (made by `reshape`), not the base
        file's: it keeps its initial value."""
        del key
        return False

    def own_parameter(self, name: str) -> bool:
        """Whether a parameter (by its name in the chunk) is the task's own: it learns beside
        the PEFT modules."""
        del name
        return False

    def make_chunks(self, trainer: Trainer) -> list[Any]:
        rows = self.base.tensors.shape(portable.EMBEDDINGS)[0]
        chunks = trainer.runtime.build_chunks(trainer.cfg, trainer.config, rows, trainer.use_te)
        self.reshape(trainer, chunks)
        settings = self.spec.peft
        if settings is not None:
            settings.check_layers(f"{self.spec.stage}.model", most_layers(trainer.cfg.model))
            self.attached = peft.attach(chunks, settings, trainer.config, self.side.peft_sites)
        if trainer.on_gpu:  # after attaching: the added modules are made on the CPU
            chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
        init_weights.load_full_tensors(
            chunks,
            self.base.tensors,
            wanted=lambda key: not peft.is_peft_key(key) and not self.own_key(key),
        )
        if self.attached is not None and settings is not None:
            start = peft.initial_values(self.attached, trainer.seed, settings.init_std)
            init_weights.assign_global(chunks, start, wanted=peft.is_peft_key)
            if self.spec.peft_restore is not None:
                restored = peft_file.read(self.spec.peft_restore)
                init_weights.load_full_tensors(chunks, restored.tensors, wanted=peft.is_peft_key)
            peft.freeze_base(chunks, keep=self.own_parameter)
        trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        total = sum(p.numel() for c in chunks for p in c.parameters())
        method = "every weight" if self.spec.method == "sft" else self.spec.method
        print(
            f"rank {trainer.rank}: {self.spec.stage} ({method}): {trainable:,} of {total:,} "
            "parameters trainable on this rank",
            flush=True,
        )
        return chunks

    # ----- data -------------------------------------------------------------------------

    def _format(self, split: Any) -> sft_data.SftFormat:
        answer_only = bool(split.section.get("answer_only_loss", self.spec.answer_only_loss))
        fmt = sft_data.SftFormat.from_section(
            split.section, split.format_key, answer_only, self.spec.virtual_tokens
        )
        seq = self.seq_length
        if fmt.max_seq_length > seq:  # every split is padded to the training length
            fmt = sft_data.SftFormat(**{**fmt.__dict__, "max_seq_length": seq})
        return fmt

    def _load(self, trainer: Trainer, split: Any, label: str) -> list[sft_data.SftFile]:
        side = self.side
        files, report = sft_data.load_files(
            list(split.files),
            self.tokenizer,
            self._format(split),
            label,
            targets=split.targets,
            encode=side.encode,
            chat=side.chat,
        )
        if report:
            trainer.say(report)
        return files

    def build_data(self, trainer: Trainer) -> Streams:
        model, recipe_trainer = trainer.cfg.model, trainer.cfg.trainer
        seq, pad = self.seq_length, self.tokenizer.eod_id
        gbs, mbs = int(model.global_batch_size), int(model.micro_batch_size)
        keys = trainer.runtime.batch_keys
        make_sample = self.side.sample_maker(trainer.cfg, self.tokenizer)
        train = self.spec.train
        files = self._load(trainer, train, "training data")
        weights = train.weights or sft_data.temperature_weights(files, train.temperature)
        if len(files) > 1:
            shares = ", ".join(
                f"{f.path.name} {w:.3f}" for f, w in zip(files, weights, strict=True)
            )
            trainer.say(f"training data mix: {shares}")
        samples = sft_data.MixedSamples(
            files,
            weights,
            int(recipe_trainer.max_steps) * gbs,
            seq,
            pad,
            trainer.seed,
            bool(train.section.get("shuffle", True)),
            make_sample,
        )
        if train.section.get("packed_sequence"):
            samples = PackedSamples(samples, len(samples), seq, pad)
        train_stream = data.SampleStream(samples, mbs, keys)
        if self.spec.validation is None:
            return Streams(train_stream, None, 0)
        valid_files = self._load(trainer, self.spec.validation, "validation data")
        valid = sft_data.EvalSamples(valid_files, gbs, seq, pad, make_sample)
        self.valid_records = valid.records
        val_batches = self.validation_batches(trainer, valid.batches)
        return Streams(train_stream, data.SampleStream(valid, mbs, keys), val_batches)

    @staticmethod
    def validation_batches(trainer: Trainer, batches: int) -> int:
        """The global batches one validation reads of the `batches` its data fills:
        trainer.limit_val_batches, a count or a share."""
        limit = trainer.cfg.trainer.get("limit_val_batches", 1.0)
        if isinstance(limit, int) and not isinstance(limit, bool):
            return min(limit, batches)
        return max(1, math.ceil(float(limit or 0) * batches))

    # ----- validation -------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        return {"method": self.spec.method, "peft": self.spec.peft and self.spec.peft.as_dict()}

    def _check_log_dir(self, cfg: Any) -> None:
        """A run of another method given the same log dir stops (on every rank) instead of
        resuming checkpoints it cannot load; tuning.json records what the dir tunes."""
        log_dir = Path(str(cfg.exp_manager.explicit_log_dir))
        path = log_dir / "tuning.json"
        if not path.exists() or not checkpointing.complete_checkpoints(log_dir / "checkpoints"):
            return
        before = json.loads(path.read_text())
        if before != json.loads(json.dumps(self._identity())):
            raise JobError(
                f"{self.spec.stage}.exp_manager.explicit_log_dir: {log_dir} holds checkpoints "
                f"of a {before['method']} run with other settings: give this run its own "
                "results dir (e.g. another run.task_name) or remove them"
            )

    def on_checkpoint(self, trainer: Trainer) -> None:
        identity = json.dumps(self._identity(), sort_keys=True)
        write_atomic(trainer.log_dir / "tuning.json", identity + "\n")

    def before_training(self, trainer: Trainer) -> None:
        """On a fresh start, measure the untuned model: the baseline of the validation curve."""
        if trainer.state.step == 0 and trainer.valid_stream is not None:
            loss = trainer.validate()
            trainer.state.metrics.clear()  # no checkpoint is named after the baseline
            if not math.isnan(loss):
                trainer.record({"step": 0, "val_loss": loss})
                trainer.say(f"validation before tuning: val_loss {loss:.4f}")

    def after_validation(self, trainer: Trainer, loss: float, outputs: list[Any]) -> None:
        del outputs
        if not math.isnan(loss):
            trainer.state.metrics["validation_loss"] = loss
        metric = self.spec.metric
        if metric.generates and self.valid_records:
            rows = self.generate_for(trainer, self.valid_records)
            step = trainer.state.step
            scores = {f"validation_{metric.name}": self._score(rows)}
            split = self.spec.validation
            assert split is not None
            for path, name in zip(
                split.files, split.names or [None] * len(split.files), strict=True
            ):
                own = [row for row in rows if row["source"].startswith(f"{path}:")]
                if name and own:  # one score per named file too (e.g. per XQuAD language)
                    scores[f"validation_{metric.name}_{name}"] = self._score(own)
                if split.section.get("write_predictions_to_file") and trainer.rank == 0:
                    prefix = split.section.get("output_file_path_prefix")
                    prefix = str(prefix or trainer.log_dir / "validation_predictions")
                    write_jsonl(Path(f"{prefix}_{name or path.stem}.jsonl"), own)
            trainer.state.metrics.update(scores)
            trainer.record({"step": step, **scores})
            trainer.say(
                f"validation at step {step}: "
                + ", ".join(f"{k.removeprefix('validation_')} {v:.3f}" for k, v in scores.items())
            )

    def _score(self, rows: list[dict[str, Any]]) -> float:
        """The metric of the generated answers: exact_string_match (any of a record's answers),
        or accuracy or f1 of the answer as a class label (recipes/answer_metrics.py)."""
        metric = self.spec.metric
        if metric.name in ("accuracy", "f1"):
            try:
                return answer_metrics.score(metric, [(r["pred"], r["label"]) for r in rows])
            except answer_metrics.TooManyClasses as error:
                raise JobError(
                    f"{self.spec.stage}.model.data.validation_ds.metric: {error}"
                ) from None
        return _share(rows)

    @torch.no_grad()
    def generate_for(
        self, trainer: Trainer, records: list[sft_data.Record]
    ) -> list[dict[str, Any]]:
        """Greedy answers to each record's prompt (after the virtual-token placeholders)."""
        prefix = [self.tokenizer.eod_id] * self.spec.virtual_tokens
        if self._format(self.spec.train).add_bos:
            prefix.append(getattr(self.tokenizer, "bos_id", self.tokenizer.eod_id))
        logits, tokenizer, limit = self.side.generation(
            trainer.cfg,
            bare_chunks(trainer),
            self.tokenizer,
            trainer.layout,
            trainer.on_gpu,
            prefix,
        )
        params = GenerationParams(tokens_to_generate=self.spec.tokens_to_generate, top_k=1)
        rows: list[dict[str, Any]] = []
        usable = [r for r in records if r.prompt]
        with trainer.eval_mode():
            for start in range(0, len(usable), GENERATION_BATCH):
                batch = usable[start : start + GENERATION_BATCH]
                fits = [
                    r
                    for r in batch
                    if len(tokenizer.encode(r.prompt)) + params.tokens_to_generate <= limit
                ]
                if not fits:
                    continue
                outputs = generate(
                    logits, tokenizer, [r.prompt for r in fits], params, max_length=limit
                )
                for record, output in zip(fits, outputs, strict=True):
                    rows.append(
                        {
                            "input": record.prompt,
                            "pred": output.text.strip(),
                            "label": record.answers[0] if record.answers else record.answer,
                            "exact_match": exact_match(output.text, record.answers),
                            "source": record.source,
                        }
                    )
        if len(rows) < len(usable):
            trainer.say(
                f"{len(usable) - len(rows)} prompts left out of generation: prompt plus "
                f"tokens_to_generate exceed the model's {limit} positions"
            )
        if not rows:
            raise JobError("no prompt fits the model for generation: shorten the prompts")
        return rows

    # ----- outputs ----------------------------------------------------------------------

    def write_outputs(self, trainer: Trainer) -> None:
        self.write_model(trainer)
        spec = self.spec
        if spec.test is not None:
            records = [r for f in self._load(trainer, spec.test, "test data") for r in f.records]
            rows = self.generate_for(trainer, records)
            path = trainer.log_dir / "test_predictions.jsonl"
            if trainer.rank == 0:
                write_jsonl(path, rows)
                name = self.spec.metric.name if self.spec.metric.generates else "exact_string_match"
                score = self._score(rows)
                trainer.say(f"test set: {name} {score:.3f} over {len(rows)}; {path}")
        dist.barrier()

    def write_model(self, trainer: Trainer) -> None:
        """The tuned model: the PEFT file of a method's tensors, or the whole model."""
        spec = self.spec
        if spec.peft is not None:
            tensors = peft_file.gather_full(bare_chunks(trainer), peft.is_peft_key)
            if trainer.rank == 0 and tensors is not None:
                extra = {
                    "stage": spec.stage,
                    # Its base's path, family and architecture: what readers compare their
                    # base with (families/file_family.py).
                    **peft_record(self.base.config, spec.base_model),
                    "data": {
                        "virtual_tokens": spec.virtual_tokens,
                        "prompt_template": str(spec.train.section.get("prompt_template") or ""),
                        "label_key": str(spec.train.section.get("label_key") or "output"),
                        "max_seq_length": spec.train.max_seq_length,
                    },
                }
                peft_file.write(spec.output_file, spec.peft, extra, tensors)
                trainer.say(f"PEFT weights ({file_size(spec.output_file)}): {spec.output_file}")
        else:
            tensors = peft_file.gather_full(bare_chunks(trainer), lambda key: True)
            if trainer.rank == 0 and tensors is not None:
                config = self.base.config.copy()
                config.tensor_model_parallel_size = trainer.layout.tensor
                config.pipeline_model_parallel_size = trainer.layout.pipeline
                portable.write(spec.output_file, config, tensors)
                trainer.say(f"fine-tuned model ({file_size(spec.output_file)}): {spec.output_file}")


def _share(rows: list[dict[str, Any]]) -> float:
    """The exact-match share of generated answers."""
    return sum(row["exact_match"] for row in rows) / len(rows)


def bare_chunks(trainer: Trainer) -> list[Any]:
    return [_unwrap(chunk) for chunk in trainer.model]


def _unwrap(chunk: Any) -> Any:
    """The GPTModel inside DDP (and Float16Module) wrappers."""
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def file_size(path: Path) -> str:
    size = path.stat().st_size
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
