"""The step boundary as values: ``Scheduler.schedule()`` returns a ``SchedulerOutput``, the model runner
turns it into tensors and returns a ``RunnerOutput``, and ``Scheduler.update`` applies that. Neither
side sees the other's objects, so a plan can be built while the device runs the previous one (async
scheduling) or be broadcast to every rank (tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloom.core.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step.

    ``token_ids`` are fed at positions ``start_pos ..``: the known tokens not yet computed, then the
    draft tokens to verify (its last ``len(draft_token_ids)`` entries). The last ``num_placeholders``
    known tokens are still on the device (async scheduling): their entries are ``PLACEHOLDER`` and the
    runner takes them from the previous step's sampled tokens of the same request.

    ``num_sample_rows`` is 0 for a prefill chunk that does not reach the end of the known tokens, else
    ``1 + len(draft_token_ids)``: one row per draft to verify plus the row of the next token.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the whole block table (a copy, never the request's own list)
    num_sample_rows: int
    sampling: SamplingParams
    draft_token_ids: list[int] = field(default_factory=list)
    num_placeholders: int = 0
    num_output_tokens: int = 0  # generated tokens before this step (for min_tokens)
    stop_token_ids: tuple[int, ...] = ()  # EOS and stop ids, blocked while under min_tokens
    history: tuple[int, ...] | None = None  # prompt + output tokens, only for requests with penalties
    num_prompt_tokens: int = 0
    # Structured outputs: int32 [num_sample_rows, ceil(vocab / 32)] on the host, bit t of a row set where
    # token t is allowed; filled by the engine from the request's grammar matcher after scheduling.
    token_bitmask: object | None = None
    # Prompt logprobs (sampling.prompt_logprobs): the prompt tokens that follow this step's first fed
    # positions, one per position whose logits score the prompt (filled by the engine after scheduling).
    prompt_targets: list[int] | None = None
    # A hybrid KV cache's other layer groups' whole block tables (copies), after ``block_ids`` (the first's)
    extra_block_ids: list[list[int]] = field(default_factory=list)
    lora_slot: int = -1  # the device slot of the request's LoRA adapter (-1: the base model)
    pooling: SeqPooling | None = None  # a pooling request: its hidden states are pooled, never sampled

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return self.num_sample_rows > 0


@dataclass(slots=True, frozen=True)
class SeqPooling:
    """What the runner keeps of a pooling request's final hidden states: ``type`` ``last`` (the last prompt
    position's), ``mean`` (a sum over each chunk's positions) or ``cls`` (the first position's); with
    ``score_token_ids``, the logits of those tokens at the last position instead."""

    type: str
    score_token_ids: tuple[int, ...] = ()

    def rows(self, start_pos: int, num_new: int, final: bool) -> tuple[int, int]:
        """The (first, count) rows of a chunk of ``num_new`` tokens from ``start_pos`` that this pooling keeps;
        ``final``: the chunk ends the prompt."""
        if self.type == "mean" and not self.score_token_ids:
            return 0, num_new
        if self.type == "cls" and not self.score_token_ids:
            return 0, 1 if start_pos == 0 else 0
        return (num_new - 1, 1) if final else (0, 0)


@dataclass(slots=True)
class PooledChunk:
    """A pooling request's share of one step: ``vector`` is the sum of its kept rows' hidden states
    (``count`` rows from position ``start``), or a score request's logits, as float32 on the host."""

    start: int
    count: int
    vector: object  # a float32 torch.Tensor [hidden] (or [len(score_token_ids)])


@dataclass(slots=True)
class LoRALoad:
    """Fill device slot ``slot`` with adapter ``adapter_id`` (read from ``path`` by a rank that lacks it)."""

    slot: int
    adapter_id: int
    name: str
    path: str


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. ``finished_request_ids`` are requests that ended since the previous plan, so
    the runner can drop what it keeps per request (seeded generators). ``lora_loads`` start moving adapters
    into device slots; requests of those adapters run in a later step, once the runner says they are in."""

    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)  # sent back to wait by this plan
    lora_loads: list[LoRALoad] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs or self.lora_loads)


@dataclass(slots=True)
class LogprobLists:
    """Logprobs of one request's new tokens, one entry per token: the token's own and the top-n."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens ``start ..`` (``start`` >= 1: the first token has no context), as the
    prefill scored them: each token's own, its rank in the distribution (1: the most likely) and the top-n."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass(slots=True)
class RunnerOutput:
    """What a step produced for each request that sampled: its accepted draft tokens followed by one
    token from the target model (so ``len - 1`` drafts were accepted), and logprobs if asked for."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    pooled: dict[str, PooledChunk] = field(default_factory=dict)
