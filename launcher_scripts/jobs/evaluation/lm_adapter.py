"""lm-evaluation-harness's model interface over a ModelRunner, at any TP/PP.

Every rank of the job runs the same lm-eval loop over the same requests: the adapter reports
rank 0 of 1 to lm-eval (its default), so lm-eval does not split requests between ranks, and
each `runner.logits` call is a collective that all ranks make with the same batch, in the same
order. Requests are sorted longest first (as lm-eval's Hugging Face model does) so batches hold
rows of similar length and padding costs little; results are returned in request order.

Conventions: a document's first token has no context, so it is conditioned on the EOD id
(Megatron/NeMo's convention; the model saw EOD before every document in training). Context
longer than the model's positions is cut from the left.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from launcher_scripts.jobs.inference.generation import GenerationParams, generate
from launcher_scripts.jobs.inference.runner import ModelRunner

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default when a task does not say
SAMPLING_SEED = 1234  # tasks that ask for sampling draw the same tokens on every run and rank

T = TypeVar("T")


class RequestError(ValueError):
    """A request this model cannot answer (too long, nothing to score): one line for the user."""


@dataclass(frozen=True)
class Scored:
    """One continuation to score: the model reads `context + continuation[:-1]` and is scored
    on predicting each token of `continuation`."""

    context: list[int]
    continuation: list[int]


class MegatronLM(LM):
    def __init__(
        self,
        runner: ModelRunner,
        batch_size: int = 1,
        progress: bool = True,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise RequestError(f"batch size {batch_size} is not >= 1")
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.batch_size = batch_size
        self.progress = progress  # off on all but one rank: the ranks do the same work
        self.info = dict(info or {})

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records as the model in its results' config."""
        return {
            **self.info,
            "max_length": self.max_length,
            "vocab_size": self.runner.vocab_size,
            "eod_id": self.eot_token_id,
        }

    @property
    def max_length(self) -> int:
        return self.runner.max_length

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    @property
    def tokenizer_name(self) -> str:
        return f"{self.tokenizer.kind}-{self.tokenizer.vocab_size}"

    # -- loglikelihood ------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        items = [self.encode_pair(*request.args) for request in requests]
        results = self.score(items, "loglikelihood")
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def encode_pair(self, context: str, continuation: str) -> Scored:
        """Tokens of the context and of what the continuation adds to it.

        The pair is encoded as one text and split where the context's own tokens end, so the
        continuation gets the tokens the model would have seen in running text. Trailing spaces
        of the context go to the continuation (a SentencePiece word carries its leading space).
        """
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return Scored([self.eot_token_id], self.tokenizer.encode(continuation))
        whole = self.tokenizer.encode(context + continuation)
        split = len(self.tokenizer.encode(context))
        # A context of no tokens at all is conditioned on EOD, like an empty one.
        return Scored(whole[:split] or [self.eot_token_id], whole[split:])

    def score(self, items: Sequence[Scored], label: str) -> list[tuple[float, bool]]:
        """(sum of log-probs of the continuation, whether greedy decoding gives it) for each item,
        in order. Batches are collective calls, the same on every rank."""
        for item in items:
            if not item.continuation:
                raise RequestError("a request's continuation adds no tokens to its context")
            if len(item.continuation) > self.max_length:
                raise RequestError(
                    f"a continuation of {len(item.continuation)} tokens exceeds the model's "
                    f"{self.max_length} positions"
                )
        results: list[tuple[float, bool]] = [(0.0, False)] * len(items)
        order = sorted(range(len(items)), key=lambda i: -_length(items[i]))
        for batch in self._batches(order, label):
            rows = [self.window(items[i]) for i in batch]
            logits = self.runner.logits(rows)
            for position, index in enumerate(batch):
                results[index] = _continuation_score(
                    logits[position], len(rows[position]), items[index].continuation
                )
        return results

    def window(self, item: Scored) -> list[int]:
        """The model's input: every token but the last, cut from the left to fit."""
        return (item.context + item.continuation)[-(self.max_length + 1) :][:-1]

    # -- loglikelihood_rolling ----------------------------------------------------------------

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        """Each document's full log-likelihood: disjoint windows of up to `max_length` scored
        tokens, each with as much preceding context as fits (lm-eval's rolling windows)."""
        windows: list[Scored] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tokenizer.encode(text),
                    prefix_token=self.eot_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append(Scored(list(context), list(continuation)))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(
            owners, self.score(windows, "loglikelihood_rolling"), strict=True
        ):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -- generate_until -----------------------------------------------------------------------

    def generate_until(self, requests: list[Instance]) -> list[str]:
        """Greedy continuations (sampled ones where a task sets do_sample), cut before the
        first of the task's `until` strings, batched among requests of equal settings."""
        outputs: list[str] = [""] * len(requests)
        groups: dict[GenerationParams, list[int]] = {}
        prompts: list[str] = []
        for index, request in enumerate(requests):
            context, kwargs = request.args
            params = generation_params(kwargs, self.tokenizer.decode([self.eot_token_id]))
            prompts.append(self._fit_prompt(context, self.max_length - params.tokens_to_generate))
            groups.setdefault(params, []).append(index)
        for params, members in groups.items():
            order = sorted(members, key=lambda i: -len(prompts[i]))
            for batch in self._batches(order, "generate_until"):
                completions = generate(
                    self.runner,
                    self.tokenizer,
                    [prompts[i] for i in batch],
                    params,
                    max_length=self.max_length,
                )
                for index, completion in zip(batch, completions, strict=True):
                    outputs[index] = completion.text
        for request, output in zip(requests, outputs, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, output)
        return outputs

    def _fit_prompt(self, context: str, budget: int) -> str:
        """The context, cut from the left to at most `budget` tokens (the generated tokens need
        the rest of the positions). Cut as tokens and decoded back; decoding can merge pieces,
        so the cut is checked against a fresh encoding."""
        if budget < 1:
            raise RequestError(
                f"max_gen_toks leaves no room for a prompt in the model's {self.max_length} "
                "positions: lower it in the task"
            )
        if not context:
            raise RequestError("generate_until needs a context to continue; a request had none")
        ids = self.tokenizer.encode(context)
        if len(ids) <= budget:
            return context
        for keep in range(budget, 0, -1):
            cut = self.tokenizer.decode(ids[-keep:])
            if cut and len(self.tokenizer.encode(cut)) <= budget:
                return cut
        raise RequestError(f"no cut of a context fits in {budget} tokens")

    # -- helpers ------------------------------------------------------------------------------

    def _batches(self, order: list[T], label: str) -> Iterator[list[T]]:
        with tqdm(total=len(order), desc=label, disable=not self.progress, mininterval=5) as bar:
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                yield batch
                bar.update(len(batch))


def _length(item: Scored) -> int:
    return len(item.context) + len(item.continuation)


def _continuation_score(
    logits: torch.Tensor, width: int, continuation: list[int]
) -> tuple[float, bool]:
    """From one row's [T, V] logits (its first `width` positions real): the continuation's
    log-prob and whether each of its tokens is the argmax. Its tokens are predicted at the
    last len(continuation) positions of the row; only those are normalised (a full-row
    log-softmax would copy the whole [T, V] tensor)."""
    positions = torch.log_softmax(logits[width - len(continuation) : width], dim=-1)
    target = torch.tensor(continuation, dtype=torch.long)
    picked = positions.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    greedy = bool((positions.argmax(dim=-1) == target).all())
    return float(picked.double().sum()), greedy


def generation_params(kwargs: dict[str, Any] | None, eod_text: str) -> GenerationParams:
    """lm-eval's gen_kwargs as GenerationParams: `until` (a string or list) are stop words,
    `max_gen_toks` the tokens to generate; greedy unless `do_sample` is true."""
    kwargs = dict(kwargs or {})
    until = kwargs.pop("until", None) or []
    stop_words = [until] if isinstance(until, str) else list(until)
    # The model's end-of-document text stops generation too, as in lm-eval's HF model (the
    # EOD id itself ends a row in any case).
    if eod_text and eod_text not in stop_words:
        stop_words.append(eod_text)
    tokens = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    if not kwargs.get("do_sample") or float(kwargs.get("temperature", 1.0)) == 0.0:
        return GenerationParams(tokens_to_generate=tokens, top_k=1, stop_words=tuple(stop_words))
    return GenerationParams(
        tokens_to_generate=tokens,
        temperature=float(kwargs.get("temperature", 1.0)),
        top_k=int(kwargs.get("top_k") or 0),
        top_p=float(kwargs.get("top_p") or 0.0),
        random_seed=SAMPLING_SEED,
        stop_words=tuple(stop_words),
    )
