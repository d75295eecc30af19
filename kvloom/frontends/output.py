"""The one output path of every frontend and of ``kvloom.LLM``: a completion's engine token deltas
turned into text deltas (incremental detokenization, stop strings held back while they may still
match), and the ``n`` completions of one prompt fanned out with one seed rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import msgspec

from kvloom.core.messages import TokenDelta, TokenLogprobs
from kvloom.core.sampling_params import SamplingParams
from kvloom.frontends.text import IncrementalText


@dataclass
class TextDelta:
    """New text of one completion; the last one has ``finish_reason`` and ``stop_reason``."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0  # tokens generated so far (usage counts these, text or not)
    prompt_logprobs: list[TokenLogprobs] | None = None  # sampling.prompt_logprobs: tokens 1.., on the first delta
    prefill_time: float | None = None  # the engine's seconds from the first step to the first token


def fan_out(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of ``n`` completions of one prompt; each runs as its own engine request
    (``n=1``). With a seed, completion ``i`` samples with ``seed + i`` (wrapped into int64): the
    completions differ from each other, and the same seeded request gives the same ``n`` again."""
    if n == 1:
        return [sampling if sampling.n == 1 else msgspec.structs.replace(sampling, n=1)]
    seed = sampling.seed
    return [msgspec.structs.replace(sampling, n=1, seed=None if seed is None else _int64(seed + i))
            for i in range(n)]


def _int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


class CompletionText:
    """One completion's engine deltas in, ``TextDelta``s out. A delta whose text is all held back (a
    partial character, a possible stop string) gives None and its tokens go with the next one. A stop
    string ends the completion with ``finish_reason="stop"`` and the string as ``stop_reason``; the
    engine, which knows only token ids, must then be told to abort (``stopped_early``).

    Without a tokenizer (a model given as token ids) the text stays empty and only tokens flow."""

    def __init__(self, tokenizer, sampling: SamplingParams, num_prompt_tokens: int = 0) -> None:
        self._text = (IncrementalText(tokenizer, sampling.stop, sampling.skip_special_tokens,
                                      sampling.include_stop_str_in_output) if tokenizer is not None else None)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_early = False  # a stop string ended it while the engine still runs the request
        self._held: list[int] = []
        self._prefill_time: float | None = None

    def add(self, delta: TokenDelta) -> TextDelta | None:
        if self.finish_reason is not None:
            return None
        self.num_output_tokens += len(delta.new_token_ids)
        finish, stop_reason = delta.finish_reason, delta.stop_token_id
        text = ""
        if self._text is not None:
            text = self._text.add_tokens(delta.new_token_ids, final=finish is not None)
            if self._text.stopped_by is not None:
                self.stopped_early = finish is None
                finish, stop_reason = "stop", self._text.stopped_by
        self._held.extend(delta.new_token_ids)
        if delta.prefill_time is not None:  # held with its tokens when their text is held back
            self._prefill_time = delta.prefill_time
        if finish is None and not text and not delta.logprobs and not delta.prompt_logprobs:
            return None
        out = TextDelta(text, self._held, delta.logprobs, finish, stop_reason,
                        delta.num_prompt_tokens or self.num_prompt_tokens, delta.num_cached_tokens,
                        self.num_output_tokens, delta.prompt_logprobs, self._prefill_time or delta.prefill_time)
        self._prefill_time = None
        self._held = []
        self.finish_reason = finish
        return out


async def coalesce(merged: AsyncIterator[tuple[int, TextDelta]], tokens: int) -> AsyncIterator[tuple[int, TextDelta]]:
    """vLLM's ``stream_interval``: each choice's deltas joined until they hold ``tokens`` tokens; a
    choice's first delta and its last go out at once."""
    held: dict[int, TextDelta] = {}
    seen: set[int] = set()
    try:
        async for index, delta in merged:
            if index in held:
                delta = _joined(held.pop(index), delta)
            if index not in seen or delta.finish_reason is not None or len(delta.token_ids) >= tokens:
                seen.add(index)
                yield index, delta
            else:
                held[index] = delta
    finally:
        await merged.aclose()


def _joined(a: TextDelta, b: TextDelta) -> TextDelta:
    """``a`` then ``b`` as one delta: the texts, tokens and logprobs of both, ``b``'s counts and ending."""
    logprobs = (a.logprobs or []) + (b.logprobs or []) if a.logprobs or b.logprobs else None
    return TextDelta(a.text + b.text, a.token_ids + b.token_ids, logprobs, b.finish_reason, b.stop_reason,
                     b.num_prompt_tokens, b.num_cached_tokens, b.num_output_tokens,
                     a.prompt_logprobs or b.prompt_logprobs, a.prefill_time or b.prefill_time)
