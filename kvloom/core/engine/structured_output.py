"""Structured outputs in the engine: grammars (JSON Schema, regex, choice, EBNF) compiled by xgrammar on
a worker thread and cached by spec, one grammar matcher per constrained request, and the token
bitmasks the sampler applies. The engine core parks a constrained request here until its grammar is
compiled, so compiling never stalls a step. Under async scheduling a matcher takes the token of the step
in flight only when the next step's masks are filled, after that step's forward is launched."""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import msgspec
import torch

from kvloom.core.engine.step import RunnerOutput, ScheduledSeq
from kvloom.core.sampling_params import StructuredOutputSpec

logger = logging.getLogger("kvloom")

GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# Threads that fill one step's masks; a mask over a 150k vocabulary in a string state takes ~0.1 ms, so
# more threads than this only add hand-off cost at the batch sizes structured requests run at.
FILL_THREADS = min(4, os.cpu_count() or 1)
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:line: "; the user needs only the rest.
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; the message says what is wrong with it."""


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# What a regex may use to be compiled as one automaton (xgrammar's ``Regex("...")`` rule) rather than
# expanded into grammar rules: Python's parse of it, as a conservative check of its constructs.
_AUTOMATON_OPS = {"LITERAL", "NOT_LITERAL", "ANY", "IN", "BRANCH", "SUBPATTERN", "MAX_REPEAT"}
_AUTOMATON_CLASS_ITEMS = {"LITERAL", "RANGE", "NEGATE", "CATEGORY"}


def regex_automaton_grammar(pattern: str) -> str | None:
    """``root ::= Regex("pattern")`` when ``pattern`` is made of literals, character classes, groups,
    alternation and greedy repetition only, else None.

    xgrammar's ``compile_regex`` expands a regex into grammar rules (a bounded repetition such as
    ``[a-z]{2,9}`` becomes a chain of optional rules), and the tokens that can cross a rule's end are
    replayed through the parser at every step, for every request: 16 masks of the benchmark's regex
    took 10 ms a step on a CPU. As one automaton the same language's masks come from its precomputed
    states: 0.25 ms (docs/benchmarks.md). Anything else (anchors, lookaround, back-references, lazy
    repetition, inline flags) keeps ``compile_regex``."""
    import re

    try:
        import re._parser as sre_parse
    except ImportError:  # Python 3.10
        import sre_parse

    if "(?" in pattern:
        return None
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None
    if parsed.state.flags & ~re.UNICODE:
        return None

    def simple(items) -> bool:
        for op, value in items:
            name = str(op)
            if name not in _AUTOMATON_OPS:
                return False
            if name == "IN" and any(str(o) not in _AUTOMATON_CLASS_ITEMS for o, _ in value):
                return False
            if name == "BRANCH" and not all(simple(b) for b in value[1]):
                return False
            if name == "SUBPATTERN" and (value[1] or value[2] or not simple(value[3])):
                return False
            if name == "MAX_REPEAT" and not simple(value[2]):
                return False
        return True

    # JSON string escapes are EBNF's too, so the literal carries the pattern unchanged.
    return f"root ::= Regex({json.dumps(pattern, ensure_ascii=False)})" if simple(parsed) else None


def xgrammar_accept(matchers: list, tokens: list[int]) -> list[bool]:
    """Each matcher advanced by its token, by a plain loop of ``accept_token``: one
    ``BatchGrammarMatcher.batch_accept_token`` call is slower at these batch sizes (docs/benchmarks.md)."""
    return [m.accept_token(t) for m, t in zip(matchers, tokens)]


class AwaitedMarker:
    """The tokens a held-back grammar waits for (``StructuredOutputSpec.after``: a reasoning block's end)
    and the newest output tokens, which may be the marker's first part."""

    def __init__(self, marker: Sequence[int]) -> None:
        self.marker = tuple(marker)
        self.tail: tuple[int, ...] = ()

    def end_in(self, tokens: Sequence[int]) -> int | None:
        """The index in ``tokens`` of the marker's last token, where the output completes it first; else None."""
        seq, m = self.tail + tuple(tokens), len(self.marker)
        for i in range(len(seq) - m + 1):
            if seq[i:i + m] == self.marker:
                return i + m - 1 - len(self.tail)
        return None

    def feed(self, tokens: Sequence[int]) -> int | None:
        """``end_in``, remembering the tokens when the marker is not complete yet."""
        end = self.end_in(tokens)
        if end is None:
            self.tail = (self.tail + tuple(tokens))[len(self.tail) + len(tokens) - len(self.marker) + 1:] \
                if len(self.marker) > 1 else ()
        return end


class StructuredOutputManager:
    """Grammar compilation and per-request matchers. The tokenizer is loaded on the compile thread at
    the first constrained request, so an engine that never sees one pays nothing."""

    def __init__(self, model: str, tokenizer: str | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._model, self._tokenizer = model, tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self._grammars: OrderedDict[StructuredOutputSpec, Future] = OrderedDict()
        self._pending: dict[str, tuple[Any, Future]] = {}  # request id -> (request, compiled grammar)
        self._matchers: dict[str, Any] = {}
        self._awaited: dict[str, AwaitedMarker] = {}  # requests whose grammar starts after a marker
        self._advanced: dict[str, int] = {}  # request id -> the newest step whose tokens its matcher took
        # The step launched and not yet applied (async scheduling): its id, and how to wait for its tokens.
        self._deferred: tuple[int, Callable[[], RunnerOutput]] | None = None
        self._batch = None  # xgrammar.BatchGrammarMatcher: one step's masks filled at once, on C++ threads
        self._masks: torch.Tensor | None = None  # the steps' mask rows, reused while large enough
        self.num_deferred_accepts = 0  # steps whose tokens were taken at the next step's fill (steps overlapped)

    # --- compilation ---------------------------------------------------------------------------------
    def _compile_future(self, spec: StructuredOutputSpec) -> Future:
        fut = self._grammars.get(spec)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._grammars.move_to_end(spec)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        fut = self._grammars[spec] = self._pool.submit(self._compile, spec)
        while len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return fut

    def _compile(self, spec: StructuredOutputSpec):
        compiler = self._grammar_compiler()
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.spec if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, strict_mode=spec.strict, any_whitespace=spec.any_whitespace)
            if spec.kind == "regex":
                automaton = regex_automaton_grammar(spec.spec)
                if automaton is not None:
                    try:
                        return compiler.compile_grammar(automaton)
                    except (RuntimeError, ValueError):
                        pass  # compile_regex names what is wrong, or compiles what the automaton could not
                return compiler.compile_regex(spec.spec)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec.spec)))
            return compiler.compile_grammar(spec.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _CPP_PREFIX.sub("", str(e)).strip() or type(e).__name__
            raise GrammarError(f"invalid {spec.kind} for structured output: {message}") from None

    def _grammar_compiler(self):
        if self._compiler is None:
            import xgrammar

            # The engine speaks token ids only; the tokenizer's vocabulary is needed once, for the masks.
            from kvloom.core.model.tokenizer import load_tokenizer

            tok = load_tokenizer(self._model, self._tokenizer)
            info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                           stop_token_ids=self._eos)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    # --- requests ------------------------------------------------------------------------------------
    def submit(self, request) -> None:
        """Start compiling ``request``'s grammar (or reuse the cached one); ``take_compiled`` hands the
        request back once it can be scheduled."""
        spec = request.sampling.structured
        # The marker a grammar waits for does not change it: one compiled grammar serves both.
        key = msgspec.structs.replace(spec, after=()) if spec.after else spec
        self._pending[request.request_id] = (request, self._compile_future(key))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def take_compiled(self, wait_s: float = 0.0) -> tuple[list, list[tuple[Any, str]]]:
        """Requests whose grammar is ready (each now has a matcher), and those whose grammar failed,
        with the reason. ``wait_s``: how long to wait for a first one when none is ready (an engine
        with nothing else to run waits here instead of spinning)."""
        if wait_s > 0:
            wait([fut for _, fut in self._pending.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        ready, failed = [], []
        for rid, (req, fut) in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[rid]
            error = fut.exception()
            if error is not None:
                failed.append((req, str(error) if isinstance(error, GrammarError)
                               else f"structured output could not be set up: {error!r}"))
                continue
            import xgrammar

            self._matchers[rid] = xgrammar.GrammarMatcher(fut.result())
            if req.sampling.structured.after:
                self._awaited[rid] = AwaitedMarker(req.sampling.structured.after)
            ready.append(req)
        return ready, failed

    def pending_requests(self) -> list:
        """Requests whose grammar is still compiling (not yet with the scheduler)."""
        return [req for req, _ in self._pending.values()]

    def drop_pending(self, request_ids: Sequence[str]) -> list:
        """Requests still waiting for their grammar among ``request_ids``, removed."""
        return [self._pending.pop(rid)[0] for rid in request_ids if rid in self._pending]

    def remove(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)
            self._advanced.pop(rid, None)
            self._awaited.pop(rid, None)

    @property
    def has_matchers(self) -> bool:
        return bool(self._matchers)

    # --- the step ------------------------------------------------------------------------------------
    def fill_bitmasks(self, seqs: Sequence[ScheduledSeq]) -> None:
        """Give each constrained sequence that samples this step one mask per sampled row: row ``j`` allows
        what its grammar allows after the sequence's drafts ``0..j-1`` (the last row, the bonus token's,
        after all of them), so the target's rows are verified under exactly the constrained distribution.

        The masks are filled round by round over the batch: round ``j`` fills row ``j`` of every sequence
        still walking its drafts, then advances those matchers by draft ``j``. A sequence stops walking
        at a draft its grammar rejects; that row's mask forbids the draft, so the target rejects it
        there and the rows after it are discarded anyway. The matchers are then rolled back: ``accept``
        advances them over the tokens that stay, once the step is verified."""
        if not self._matchers:
            return
        self._take_deferred(seqs)
        # A matcher that accepted a stop token has nothing left to allow (only ignore_eos gets here, or a
        # request whose stop token was taken from the step in flight: this step's token is dropped).
        constrained, starts = [], []  # and each one's first constrained row
        for s in seqs:
            if not s.samples or s.request_id not in self._matchers or self._matchers[s.request_id].is_terminated():
                continue
            awaited = self._awaited.get(s.request_id)
            end = awaited.end_in(s.draft_token_ids) if awaited is not None else -1
            if end is not None:  # else its marker is not in sight: every row stays free
                constrained.append(s)
                starts.append(end + 1)
        if not constrained:
            return
        import xgrammar

        if self._batch is None:
            self._batch = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)
        # One mask tensor for the step; rows[i] is sequence i's first sampled row.
        rows = [0]
        for s in constrained:
            rows.append(rows[-1] + s.num_sample_rows)
        masks = self._mask_rows(rows[-1])
        matchers = [self._matchers[s.request_id] for s in constrained]
        advanced = [0] * len(constrained)
        walking = list(range(len(constrained)))
        j = 0
        while walking:
            self._batch.batch_fill_next_token_bitmask([matchers[i] for i in walking], masks,
                                                      [rows[i] + starts[i] + j for i in walking])
            walking = [i for i in walking if starts[i] + j < len(constrained[i].draft_token_ids)]
            if walking:
                kept = xgrammar.BatchGrammarMatcher.batch_accept_token(
                    [matchers[i] for i in walking], [constrained[i].draft_token_ids[starts[i] + j] for i in walking])
                walking = [i for i, ok in zip(walking, kept) if ok]
                for i in walking:
                    advanced[i] += 1
                # A draft that ended the grammar (a stop token) leaves no next mask to fill; the request
                # stops there if the target keeps it.
                walking = [i for i in walking if not matchers[i].is_terminated()]
            j += 1
        back = [(m, n) for m, n in zip(matchers, advanced) if n]
        if back:
            xgrammar.BatchGrammarMatcher.batch_rollback([m for m, _ in back], [n for _, n in back])
        for s, start, end in zip(constrained, rows, rows[1:]):
            s.token_bitmask = masks[start:end]

    def _mask_rows(self, n: int) -> torch.Tensor:
        """``n`` rows of the reused mask buffer, every token allowed until filled (a row a draft walk does
        not reach stays so). The sampler copies the rows it applies before the next step fills them."""
        words = (self.vocab_size + 31) // 32
        if self._masks is None or self._masks.shape[0] < n:
            self._masks = torch.empty(max(n, 2 * (self._masks.shape[0] if self._masks is not None else 8)), words,
                                      dtype=torch.int32)
        masks = self._masks[:n]
        masks.fill_(-1)
        return masks

    def defer(self, step_id: int, fetch: Callable[[], RunnerOutput]) -> None:
        """Step ``step_id`` is launched and its tokens are not applied yet (async scheduling): the next
        step's fill first takes them, from ``fetch``, for the sequences whose newest token they are. By
        then that step's forward is queued behind them, so waiting for them costs the device nothing."""
        self._deferred = (step_id, fetch) if self._matchers else None

    def _take_deferred(self, seqs: Sequence[ScheduledSeq]) -> None:
        if self._deferred is None:
            return
        # A placeholder is a token of the step in flight (only one is, and only its newest token): the
        # sequence's mask needs its matcher past that token. A request new in this step has none, so
        # a reused request id never takes an aborted namesake's token.
        waiting = [s.request_id for s in seqs if s.num_placeholders and s.samples and s.request_id in self._matchers]
        if not waiting:
            return
        step_id, fetch = self._deferred
        self._deferred = None
        sampled = fetch().sampled_token_ids
        self.accept_step(step_id, {rid: sampled[rid] for rid in waiting if rid in sampled})
        self.num_deferred_accepts += 1

    def accept_step(self, step_id: int, tokens: dict[str, Sequence[int]]) -> None:
        """Advance each request's matcher over its tokens from step ``step_id``, once: a matcher that took
        them at the next step's fill skips them when the step is applied. Batched: round ``j`` advances
        every matcher that has a ``j``-th token (one round unless drafts were verified)."""
        if self._deferred is not None and self._deferred[0] <= step_id:
            self._deferred = None
        todo = []
        for rid, toks in tokens.items():
            matcher = self._matchers.get(rid)
            if matcher is None or not toks or self._advanced.get(rid, -1) >= step_id:
                continue
            self._advanced[rid] = step_id
            awaited = self._awaited.get(rid)
            if awaited is not None:  # the grammar starts after the marker: only the tokens past it are its
                end = awaited.feed(toks)
                if end is None:
                    continue
                del self._awaited[rid]
                toks = toks[end + 1:]
                if not toks:
                    continue
            todo.append((rid, matcher, toks))
        j = 0
        while todo:
            todo = [t for t in todo if not t[1].is_terminated()]
            if not todo:
                break
            kept = xgrammar_accept([m for _, m, _ in todo], [toks[j] for _, _, toks in todo])
            for (rid, _, toks), ok in zip(todo, kept):
                if not ok:
                    # Only a stop token the grammar has not reached yet can get here (ignore_eos, max_tokens);
                    # the mask stops anything else. The request ends on that token anyway.
                    logger.debug("Request %s: token %d not accepted by its grammar", rid, toks[j])
            j += 1
            todo = [t for t, ok in zip(todo, kept) if ok and len(t[2]) > j]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
