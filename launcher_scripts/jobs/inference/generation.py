"""Text generation over a model's KV cache: greedy, sampling, beam search, streaming.

The engine sees the model only through a cache (`Decoding.cache(slots, positions)`): `add`
prompts and get their next-token logits, `step` every live sequence by one token, `fork` a
sequence (a beam's second child), `drop` a finished one. The GPT family's cache is
megatron-core's inference context through the model's own modules (kv_cache.py), at any
TP/PP: every rank calls `generate` with the same arguments, every rank gets the same logits,
and every rank must then pick the same tokens. Greedy and beam search are deterministic;
sampling draws from a `torch.Generator` seeded identically on every rank (`random_seed`, or
with no seed one drawn on rank 0 and broadcast), never from a per-rank random state.

A model given as a bare logits function over whole rows (`LogitsFn`) is wrapped in
`Recomputing`, which reruns every row at each step: what a family without a cache yet uses.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from launcher_scripts.jobs.inference.engine import Engine
from launcher_scripts.recipes.generation_params import MAX_SEED, GenerationParams

LogitsFn = Callable[[list[list[int]]], torch.Tensor]
FINISH_REASONS = ("length", "stop", "eod")


class Cache(Protocol):
    """Sequences by handle; every call is collective over a TP/PP group (same order on every
    rank). Logits are [n, V] float32 on the CPU, one row per sequence named."""

    def add(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]: ...

    def step(self, sequences: Sequence[int], tokens: Sequence[int]) -> torch.Tensor: ...

    def fork(self, sequence: int) -> int: ...

    def drop(self, sequence: int) -> None: ...


class Decoding(Protocol):
    def cache(self, slots: int, positions: int) -> Cache: ...


class Recomputing:
    """A `Decoding` over a logits function of whole right-padded rows: each step reruns every
    live row (no cache), for models whose family has no KV cache yet."""

    def __init__(self, logits_fn: LogitsFn) -> None:
        self.logits_fn = logits_fn

    def cache(self, slots: int, positions: int) -> _RecomputedRows:
        return _RecomputedRows(self.logits_fn)


class _RecomputedRows:
    def __init__(self, logits_fn: LogitsFn) -> None:
        self.logits_fn = logits_fn
        self.rows: dict[int, list[int]] = {}
        self.handles = 0

    def add(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
        added = []
        for prompt in prompts:
            self.rows[self.handles] = list(prompt)
            added.append(self.handles)
            self.handles += 1
        return added, self._last(added)

    def step(self, sequences: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        for sequence, token in zip(sequences, tokens, strict=True):
            self.rows[sequence].append(token)
        return self._last(list(sequences))

    def fork(self, sequence: int) -> int:
        self.rows[self.handles] = list(self.rows[sequence])
        self.handles += 1
        return self.handles - 1

    def drop(self, sequence: int) -> None:
        del self.rows[sequence]

    def _last(self, sequences: list[int]) -> torch.Tensor:
        rows = [self.rows[s] for s in sequences]
        logits = self.logits_fn(rows)
        last = torch.tensor([len(row) - 1 for row in rows])
        return logits[torch.arange(len(rows)), last].float()


class Prefixed:
    """A `Decoding` whose every prompt starts with `prefix` (a tuned model's virtual-token
    placeholders): the caller's prompts and positions leave it out."""

    def __init__(self, decoding: Decoding, prefix: Sequence[int]) -> None:
        self.decoding, self.prefix = decoding, list(prefix)

    def cache(self, slots: int, positions: int) -> _PrefixedRows:
        return _PrefixedRows(self.decoding.cache(slots, positions + len(self.prefix)), self.prefix)


class _PrefixedRows:
    def __init__(self, cache: Cache, prefix: list[int]) -> None:
        self.inner, self.prefix = cache, prefix

    def add(self, prompts: Sequence[Sequence[int]]) -> tuple[list[int], torch.Tensor]:
        return self.inner.add([[*self.prefix, *prompt] for prompt in prompts])

    def step(self, sequences: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self.inner.step(sequences, tokens)

    def fork(self, sequence: int) -> int:
        return self.inner.fork(sequence)

    def drop(self, sequence: int) -> None:
        self.inner.drop(sequence)


def decoding_of(model: Decoding | LogitsFn) -> Decoding:
    return model if hasattr(model, "cache") else Recomputing(model)  # type: ignore[arg-type]


class Tokenizer(Protocol):
    """What generation needs of `text_tokenizer.TextTokenizer`."""

    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class Completion:
    """What one prompt produced: the continuation only, not the prompt.

    `text` is what the generated ids add after the prompt's text (so it may start with a
    space), cut before the first stop word; `tokens` leave out the eod id and the tokens of a
    stop word (all of a token that holds text both before and in it is left out too).
    """

    text: str
    tokens: list[int]
    finish_reason: str  # one of FINISH_REASONS


# ---------------------------------------------------------------------------------------------
# Sampling math on [B, V] logits of the next token.


def apply_repetition_penalty(
    logits: torch.Tensor, seen: Sequence[Sequence[int]], penalty: float
) -> torch.Tensor:
    """CTRL's penalty on every token a row has seen (prompt and generated): a positive logit is
    divided by the penalty, a negative one multiplied, so either way it loses probability."""
    if penalty == 1.0:
        return logits
    out = logits.clone()
    for row, ids in enumerate(seen):
        index = torch.tensor(sorted(set(ids)), dtype=torch.long)
        values = out[row, index]
        out[row, index] = torch.where(values > 0, values / penalty, values * penalty)
    return out


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits of each row (and any tied with the k-th); 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, -math.inf)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep each row's most probable tokens until their mass reaches p (at least one token)."""
    if p <= 0.0 or p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def filter_logits(
    logits: torch.Tensor, seen: Sequence[Sequence[int]], params: GenerationParams
) -> torch.Tensor:
    """The distribution sampling draws from, as logits (-inf for removed tokens)."""
    logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logits = apply_temperature(logits, params.temperature)
    logits = top_k_filter(logits, params.top_k)
    return top_p_filter(logits, params.top_p)


def next_tokens(
    logits: torch.Tensor,
    seen: Sequence[Sequence[int]],
    params: GenerationParams,
    generator: torch.Generator | None,
) -> list[int]:
    """One token per row of [B, V] next-token logits; `generator` is needed unless greedy."""
    if params.greedy:
        penalized = apply_repetition_penalty(logits, seen, params.repetition_penalty)
        return penalized.argmax(dim=-1).tolist()
    if generator is None:
        raise ValueError("sampling needs a generator in the same state on every rank")
    probs = filter_logits(logits, seen, params).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).tolist()


def shared_generator(seed: int | None, replicated: bool = True) -> torch.Generator:
    """A generator in the same state on every rank, so TP/PP ranks sample the same tokens.

    With no seed, rank 0 draws one and broadcasts it (a collective: all ranks call this), unless
    the generation is not `replicated` (only rank 0 picks tokens; the others follow its cache
    calls, broadcast_cache.py).
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") & MAX_SEED
        seed = _broadcast_seed(seed) if replicated else seed
    return torch.Generator().manual_seed(seed)


def _broadcast_seed(seed: int) -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seed
    value = torch.tensor([seed], dtype=torch.int64)
    dist.broadcast(value, src=0)
    return int(value.item())


# ---------------------------------------------------------------------------------------------
# Text of a continuation, stop words.


@dataclass
class _Prompt:
    ids: list[int]
    text: str  # the prompt ids decoded: what a continuation is decoded against


def _continuation(tokenizer: Tokenizer, prompt: _Prompt, generated: Sequence[int]) -> str:
    """The text the generated ids add after the prompt.

    Decoded together with the prompt because SentencePiece drops the leading space of a
    sequence's first piece: "world" alone, but " world" after "Hello".
    """
    full = tokenizer.decode([*prompt.ids, *generated])
    if full.startswith(prompt.text):
        return full[len(prompt.text) :]
    return tokenizer.decode(list(generated))


def _stop_at(text: str, stop_words: Sequence[str]) -> int | None:
    """Where the earliest stop word starts in text, if one does."""
    found = [i for i in (text.find(word) for word in stop_words) if i >= 0]
    return min(found) if found else None


def _tokens_before(
    tokenizer: Tokenizer, prompt: _Prompt, generated: list[int], text: str, cut: int
) -> list[int]:
    """The longest prefix of the generated ids whose text lies within text[:cut]."""
    for n in range(len(generated), -1, -1):
        piece = _continuation(tokenizer, prompt, generated[:n])
        if len(piece) <= cut and text.startswith(piece):
            return generated[:n]
    return []


def _held_back(text: str, stop_words: Sequence[str]) -> int:
    """How many trailing characters a stream must hold: the longest suffix that may grow into a
    stop word, and undecodable bytes (U+FFFD) that the next token may complete."""
    hold = 0
    for word in stop_words:
        for size in range(min(len(word) - 1, len(text)), hold, -1):
            if text.endswith(word[:size]):
                hold = size
                break
    safe = len(text) - hold
    while safe > 0 and text[safe - 1] == "\ufffd":
        safe -= 1
    return len(text) - safe


# ---------------------------------------------------------------------------------------------
# Prompts.


def continuation_text(
    tokenizer: Tokenizer, prompt_ids: Sequence[int], generated: Sequence[int]
) -> str:
    """The text `generated` adds after a prompt given as ids (what postprocessing decodes)."""
    ids = list(prompt_ids)
    return _continuation(tokenizer, _Prompt(ids, tokenizer.decode(ids)), generated)


def prompt_ids(tokenizer: Tokenizer, prompt: Any, name: str) -> list[int]:
    """A prompt's ids: a string's encoding, or a list of token ids checked against the
    tokenizer's vocabulary (ValueError naming the problem)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"{name} is empty: give some text to continue")
        return ids
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"{name} is a {type(prompt).__name__}; expected a string or a list of token ids"
        )
    if not prompt:
        raise ValueError(f"{name} has no token ids: give at least one")
    vocab = tokenizer.vocab_size
    for position, token in enumerate(prompt):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(
                f"{name}: token id {token!r} at position {position} is not an id of the "
                f"model's tokenizer (0 to {vocab - 1})"
            )
    return list(prompt)


def _encode_prompts(
    tokenizer: Tokenizer, prompts: Sequence[Any], params: GenerationParams, max_length: int
) -> list[_Prompt]:
    if isinstance(prompts, str):
        raise ValueError("prompts must be a list of strings, not one string")
    if not prompts:
        raise ValueError("no prompts: give at least one")
    encoded = []
    for index, prompt in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt {index}"
        ids = prompt_ids(tokenizer, prompt, name)
        total = len(ids) + params.tokens_to_generate
        if total > max_length:
            raise ValueError(
                f"{name} is {len(ids)} tokens; {len(ids)} + tokens_to_generate "
                f"{params.tokens_to_generate} exceeds the model's {max_length} positions: "
                "shorten the prompt or lower tokens_to_generate"
            )
        encoded.append(_Prompt(ids, tokenizer.decode(ids)))
    return encoded


# ---------------------------------------------------------------------------------------------
# Greedy and sampling.


@dataclass
class _Row:
    prompt: _Prompt
    tokenizer: Tokenizer
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    decoded: str | None = ""  # the continuation's text; None: not decoded since the last token

    @property
    def text(self) -> str:
        """Decoded when asked for (stop words, a stream, the result): decoding the whole row
        after every token would cost each step time that grows with the row."""
        if self.decoded is None:
            self.decoded = _continuation(self.tokenizer, self.prompt, self.generated)
        return self.decoded

    def seen(self) -> list[int]:
        return [*self.prompt.ids, *self.generated]

    def add(self, token: int, params: GenerationParams) -> None:
        """Take one sampled token and decide whether the row is done."""
        if token == self.tokenizer.eod_id:
            self.finish_reason = "eod"
            return
        self.generated.append(token)
        self.decoded = None
        cut = _stop_at(self.text, params.stop_words) if params.stop_words else None
        if cut is not None:
            self.generated = _tokens_before(
                self.tokenizer, self.prompt, self.generated, self.text, cut
            )
            self.decoded = self.text[:cut]
            self.finish_reason = "stop"
        elif len(self.generated) == params.tokens_to_generate:
            self.finish_reason = "length"

    def completion(self) -> Completion:
        return Completion(self.text, list(self.generated), self.finish_reason or "length")


def _positions_needed(prompts: Sequence[_Prompt], params: GenerationParams) -> int:
    """Cache positions for these prompts: each prompt and all its tokens but the last (which is
    returned, never fed back)."""
    return max(len(prompt.ids) for prompt in prompts) + params.tokens_to_generate - 1


class _PromptsTask:
    """What every engine task over prompts that share parameters knows. `replicated`: every
    rank of a TP/PP group runs it (generate()); otherwise rank 0 alone (a server)."""

    def __init__(
        self,
        prompts: list[_Prompt],
        params: GenerationParams,
        tokenizer: Tokenizer,
        replicated: bool = True,
    ):
        self.params, self.tokenizer, self.replicated = params, tokenizer, replicated
        self.slots = len(prompts) * params.beam_width
        self.positions = _positions_needed(prompts, params)
        self._hold(prompts)

    def _hold(self, prompts: list[_Prompt]) -> None:
        raise NotImplementedError


class SamplingTask(_PromptsTask):
    """Greedy or sampled continuations of prompts that share parameters: one engine task. Its
    rows draw from one generator in turn (seeded alike on every rank)."""

    def _hold(self, prompts: list[_Prompt]) -> None:
        self.rows = [_Row(prompt, self.tokenizer) for prompt in prompts]
        seed = self.params.random_seed
        greedy = self.params.greedy
        self.generator = None if greedy else shared_generator(seed, self.replicated)
        self.live: list[tuple[_Row, int, int]] = []  # row, cache sequence, token to feed

    def prompts(self) -> list[list[int]]:
        return [row.prompt.ids for row in self.rows]

    def begin(self, handles: list[int], logits: torch.Tensor, cache: Cache) -> None:
        self._take(list(zip(self.rows, handles, strict=True)), logits, cache)

    def feeds(self) -> list[tuple[int, int]]:
        return [(handle, token) for _, handle, token in self.live]

    def advance(self, logits: dict[int, torch.Tensor], cache: Cache) -> None:
        active = [(row, handle) for row, handle, _ in self.live]
        self._take(active, torch.stack([logits[handle] for _, handle in active]), cache)

    def release(self, cache: Cache) -> None:
        for _, handle, _ in self.live:
            cache.drop(handle)
        self.live = []

    @property
    def done(self) -> bool:
        return not self.live

    def results(self) -> list[Completion]:
        return [row.completion() for row in self.rows]

    def _take(self, active: list[tuple[_Row, int]], logits: torch.Tensor, cache: Cache) -> None:
        """One token per active row from its [V] logits; a finished row leaves the cache."""
        seen = [row.seen() for row, _ in active]
        vocab = self.tokenizer.vocab_size
        tokens = next_tokens(logits[:, :vocab].float(), seen, self.params, self.generator)
        self.live = []
        for (row, handle), token in zip(active, tokens, strict=True):
            row.add(token, self.params)
            if row.finish_reason is None:
                self.live.append((row, handle, token))
            else:
                cache.drop(handle)


# ---------------------------------------------------------------------------------------------
# Beam search.


@dataclass
class _Hypothesis:
    score: float
    generated: list[int]
    text: str
    finish_reason: str


@dataclass
class _Beams:
    """One prompt's beam search: live beams as (generated ids, sum of log-probs, the cache
    sequence that holds them; during a step, the index of the parent beam instead)."""

    prompt: _Prompt
    live: list[tuple[list[int], float, int]] = field(default_factory=list)
    finished: list[_Hypothesis] = field(default_factory=list)

    def finish(self, hypothesis: _Hypothesis, width: int) -> None:
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[width:]

    def done(self, params: GenerationParams) -> bool:
        """No live beam left, or none that can still beat the worst of `width` finished ones.

        Log-probs are <= 0, so a live beam's sum only falls; its best possible score is at its
        current length when length_penalty >= 0 (length^p only grows) and at the longest
        length otherwise.
        """
        if not self.live:
            return True
        if len(self.finished) < params.beam_width:
            return False
        best = max(
            _bound(total, len(ids), params.tokens_to_generate, params.length_penalty)
            for ids, total, _ in self.live
        )
        return best <= self.finished[-1].score

    def result(self) -> Completion:
        if not self.finished:
            raise RuntimeError("beam search finished no hypothesis: every token was masked")
        best = self.finished[0]
        return Completion(best.text, best.generated, best.finish_reason)


def _score(total: float, length: int, length_penalty: float) -> float:
    """A finished hypothesis's score: its log-probability sum x length^length_penalty. The sum
    is <= 0, so a larger penalty prefers shorter hypotheses (the meaning NeMo's Triton guide
    gives it); -1 is the mean log-probability (Hugging Face's length_penalty=1)."""
    return total * (max(length, 1) ** length_penalty)


def _bound(total: float, length: int, longest: int, length_penalty: float) -> float:
    return _score(total, length if length_penalty >= 0 else longest, length_penalty)


def _beam_step(
    beams: _Beams, logits: torch.Tensor, tokenizer: Tokenizer, params: GenerationParams
) -> None:
    """Extend the live beams of one prompt by one token, given their [n, V] logits; each new
    live beam records its parent's index (see _settle)."""
    width = params.beam_width
    seen = [[*beams.prompt.ids, *ids] for ids, _, _ in beams.live]
    logprobs = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    logprobs = logprobs.log_softmax(dim=-1)
    totals = logprobs + torch.tensor([total for _, total, _ in beams.live]).unsqueeze(-1)
    vocab = totals.shape[-1]
    # 2 * width candidates leave `width` to continue even if half of them end in eod; no beam
    # gives more than that many, so each beam's best 2 * width are all there is to rank.
    per_beam, tokens = totals.topk(min(2 * width, vocab), dim=-1)
    if params.beam_search_diversity_rate:
        # Li, Monroe and Jurafsky (2016): a beam's k-th best continuation loses rate x k.
        ranks = torch.arange(per_beam.shape[-1], dtype=per_beam.dtype)
        per_beam = per_beam - params.beam_search_diversity_rate * ranks
    values, picked = per_beam.flatten().topk(min(2 * width, per_beam.numel()))
    rows = picked // per_beam.shape[-1]
    flat = rows * vocab + tokens.flatten()[picked]
    live: list[tuple[list[int], float, int]] = []
    for rank, (value, index) in enumerate(zip(values.tolist(), flat.tolist(), strict=True)):
        if value == -math.inf or len(live) == width:
            break
        parent = index // vocab
        ids = [*beams.live[parent][0], index % vocab]
        if ids[-1] == tokenizer.eod_id:
            if rank < width:  # an eod outside the top `width` is no better than a live beam
                text = _continuation(tokenizer, beams.prompt, ids[:-1])
                score = _score(value, len(ids), params.length_penalty)
                beams.finish(_Hypothesis(score, ids[:-1], text, "eod"), width)
            continue
        text = _continuation(tokenizer, beams.prompt, ids)
        cut = _stop_at(text, params.stop_words)
        if cut is not None:
            kept = _tokens_before(tokenizer, beams.prompt, ids, text, cut)
            score = _score(value, len(ids), params.length_penalty)
            beams.finish(_Hypothesis(score, kept, text[:cut], "stop"), width)
        elif len(ids) == params.tokens_to_generate:
            score = _score(value, len(ids), params.length_penalty)
            beams.finish(_Hypothesis(score, ids, text, "length"), width)
        else:
            live.append((ids, value, parent))
    beams.live = live


def _settle(beams: _Beams, parents: list[int], cache: Cache) -> None:
    """Give each new live beam a cache sequence: its parent's for the first child, a fork of
    it for the others; parents without children are dropped first (so forks find slots)."""
    children = {parent for _, _, parent in beams.live}
    for index, handle in enumerate(parents):
        if index not in children:
            cache.drop(handle)
    claimed: set[int] = set()
    settled = []
    for ids, total, parent in beams.live:
        handle = cache.fork(parents[parent]) if parent in claimed else parents[parent]
        claimed.add(parent)
        settled.append((ids, total, handle))
    beams.live = settled


class BeamTask(_PromptsTask):
    """Beam search for prompts that share parameters: one engine task, every live beam of every
    prompt stepped together."""

    def _hold(self, prompts: list[_Prompt]) -> None:
        self.searches = [_Beams(prompt) for prompt in prompts]

    def prompts(self) -> list[list[int]]:
        return [search.prompt.ids for search in self.searches]

    def begin(self, handles: list[int], logits: torch.Tensor, cache: Cache) -> None:
        for search, handle in zip(self.searches, handles, strict=True):
            search.live = [([], 0.0, handle)]
        rows = dict(zip(handles, logits, strict=True))
        self.advance(rows, cache)

    def feeds(self) -> list[tuple[int, int]]:
        return [(handle, ids[-1]) for search in self.searches for ids, _, handle in search.live]

    def advance(self, logits: dict[int, torch.Tensor], cache: Cache) -> None:
        vocab = self.tokenizer.vocab_size
        for search in self.searches:
            if not search.live:
                continue
            parents = [handle for _, _, handle in search.live]
            rows = torch.stack([logits[handle] for handle in parents])[:, :vocab].float()
            _beam_step(search, rows, self.tokenizer, self.params)
            _settle(search, parents, cache)
            if search.done(self.params):
                for _, _, handle in search.live:
                    cache.drop(handle)
                search.live = []

    def release(self, cache: Cache) -> None:
        for search in self.searches:
            for _, _, handle in search.live:
                cache.drop(handle)
            search.live = []

    @property
    def done(self) -> bool:
        return not any(search.live for search in self.searches)

    def results(self) -> list[Completion]:
        return [search.result() for search in self.searches]


# ---------------------------------------------------------------------------------------------
# Entry points.


def task_for(
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    params: GenerationParams,
    max_length: int,
    replicated: bool = True,
) -> SamplingTask | BeamTask:
    """The engine task that continues these prompts (checked against the model's positions).
    `replicated`: every rank of a TP/PP group runs it (generate()); otherwise rank 0 alone."""
    params.check()
    encoded = _encode_prompts(tokenizer, prompts, params, max_length)
    kind = BeamTask if params.beam_width > 1 else SamplingTask
    return kind(encoded, params, tokenizer, replicated)


def generate(
    model: Decoding | LogitsFn,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    params: GenerationParams,
    *,
    max_length: int,
) -> list[Completion]:
    """Continue each prompt; all prompts advance together, one cache step per token.

    `max_length` is the model's number of positions: a prompt whose tokens plus
    `tokens_to_generate` exceed it is refused. Sampled text depends on the seed and on the batch
    (rows draw from one generator in turn); greedy and beam search depend on neither.
    """
    task = task_for(tokenizer, prompts, params, max_length)
    engine = Engine(decoding_of(model).cache(task.slots, task.positions))
    engine.admit(task)
    while not task.done:
        engine.step()
    return task.results()


def stream(
    model: Decoding | LogitsFn,
    tokenizer: Tokenizer,
    prompt: str,
    params: GenerationParams,
    *,
    max_length: int,
) -> Iterator[str]:
    """Continue one prompt, yielding text as it becomes final.

    The pieces join to `generate(...)[0].text` for the same arguments: text that may still
    become a stop word, or an incomplete UTF-8 character, is held until it is decided.
    Beam search cannot stream (the best beam is known only at the end).
    """
    params.check()
    if params.beam_width != 1:
        raise ValueError(f"beam_width: {params.beam_width} cannot stream; use beam_width 1")
    task = SamplingTask(_encode_prompts(tokenizer, [prompt], params, max_length), params, tokenizer)
    engine = Engine(decoding_of(model).cache(task.slots, task.positions))
    engine.admit(task)
    text = StreamedText(task)
    while not task.done:
        piece = text.ready()
        if piece:
            yield piece
        engine.step()
    piece = text.ready()
    if piece:
        yield piece


class StreamedText:
    """The text of a one-prompt sampling task as it becomes final: `ready()` after each step
    gives what was decided since the last call. Text that may still become a stop word, or an
    incomplete UTF-8 character, is held until it is decided; the pieces join to the row's text."""

    def __init__(self, task: SamplingTask) -> None:
        if len(task.rows) != 1:
            raise ValueError("a stream continues one prompt")
        self.row, self.stop_words = task.rows[0], task.params.stop_words
        self.sent = ""

    def ready(self) -> str:
        text = self.row.text
        if self.row.finish_reason is None:
            text = text[: len(text) - _held_back(text, self.stop_words)]
        # A decode that rewrote earlier text (never seen with SentencePiece) waits for the end.
        if len(text) > len(self.sent) and text.startswith(self.sent):
            piece, self.sent = text[len(self.sent) :], text
            return piece
        return ""
