"""The engine's live request object (the wire form is ``messages.AddRequest``)."""

from __future__ import annotations

import enum
import itertools
import time

from kvloom.core.messages import AddRequest
from kvloom.core.sampling_params import SamplingParams

_arrival_counter = itertools.count()

# Stands for a sampled token that is still on the GPU (async scheduling); the model runner feeds the
# real id from the device, and the scheduler writes it in once the step's results arrive. A request
# counts its placeholders (``num_unresolved``): they are always its newest tokens.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    finished: bool  # set on each member below


# A plain attribute per member: read for every request of every step, and Enum's ``value`` is a
# Python-level descriptor (about a tenth of the host's time per step at 256 requests).
for _status in RequestStatus:
    _status.finished = _status.value in ("stop", "length", "abort", "error")
del _status


class Request:
    """A request inside the engine. Progress is one number, ``num_computed_tokens``: how many of
    ``all_token_ids`` have their KV in the cache. Prefill, chunked prefill, prefix-cache hits,
    recompute after preemption and speculative tokens are all just different values of it.

    Draft tokens of speculative decoding live apart, in ``spec_token_ids``, until the target model
    verifies them: stop checks, penalties, logprobs and prefix-cache hashes only ever see
    ``all_token_ids``, which holds the prompt and accepted tokens."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        client_index: int = 0,
        eos_token_ids: tuple[int, ...] = (),
        max_tokens: int,
        deadline: float | None = None,
        queue_deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.arrival_order = next(_arrival_counter)  # ties broken by order of arrival
        self.client_index = client_index
        self.eos_token_ids = () if sampling.ignore_eos else tuple(eos_token_ids)
        self.stop_token_ids = frozenset(sampling.stop_token_ids)
        self.max_tokens = max_tokens  # resolved against max_model_len at admission
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        # A hybrid KV cache's other layer groups' tables, and per group the leading blocks given back
        # (outside a sliding window) or never held (a prefix hit's blocks before a window)
        self.extra_block_ids: list[list[int]] = []
        self.num_skipped_blocks: list[int] = []
        self.block_hashes: list = []  # chained hashes of full blocks, filled in by the prefix cache
        self.stop_token_id: int | None = None
        self.spec_token_ids: list[int] = []  # draft tokens proposed for the next step, not yet verified
        self.num_unresolved = 0  # newest tokens that are placeholders (sampled on the device, in flight)
        self.num_draft_tokens = 0  # drafts verified so far (speculative decoding)
        self.num_accepted_tokens = 0  # of which the target accepted
        self.num_spec_steps = 0  # steps that verified at least one draft
        # Moving average of the accepted fraction, for the adaptive policy: a new request starts at 0.5, so
        # four steps with nothing accepted stop its drafts.
        self.recent_acceptance = 0.5
        self.spec_failed_probes = 0  # probes in a row since its drafts stopped, for the policy's back-off
        self.first_scheduled_time: float | None = None
        self.awaiting_final_token = False  # its last possible token is in flight: schedule it no more
        self.deadline = deadline  # wall-clock times (the scheduler's clock): aborted past it
        self.queue_deadline = queue_deadline  # dropped past it if it has not had its first step
        # LoRA: the adapter (0: the base model), its name, the digest its KV blocks are keyed by, and the
        # device slot the scheduler found it in for the current step.
        self.lora_id = 0
        self.lora_name = ""
        self.lora_key = ""
        self.lora_slot = -1
        self.pooling = None  # step.SeqPooling of a pooling request (prefill only, its hidden states pooled)
        self.pooling_params = None  # and its messages.PoolingParams (dimensions, normalize)

    @classmethod
    def from_message(cls, msg: AddRequest, *, eos_token_ids: tuple[int, ...], max_tokens: int) -> "Request":
        return cls(
            msg.request_id, msg.prompt_token_ids, msg.sampling, priority=msg.priority,
            arrival_time=msg.arrival_time or None, client_index=msg.client_index,
            eos_token_ids=eos_token_ids, max_tokens=max_tokens, deadline=msg.deadline,
            queue_deadline=msg.queue_deadline,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def set_token(self, index: int, token_id: int) -> None:
        """Replace the placeholder at ``all_token_ids[index]`` with the sampled token."""
        self.all_token_ids[index] = token_id
        self.output_token_ids[index - len(self.prompt_token_ids)] = token_id

    def truncate(self, num_tokens: int) -> None:
        """Drop tokens past the first ``num_tokens`` (placeholders sampled after the request stopped)."""
        del self.all_token_ids[num_tokens:]
        del self.output_token_ids[max(0, num_tokens - self.num_prompt_tokens):]

    @property
    def has_placeholder(self) -> bool:
        return self.num_unresolved > 0

    def check_stop(self, index: int | None = None) -> RequestStatus | None:
        """The finished status after the token at ``all_token_ids[index]`` (default: the newest one),
        or None to keep going."""
        index = len(self.all_token_ids) - 1 if index is None else index
        n_out = index + 1 - len(self.prompt_token_ids)
        last = self.all_token_ids[index]
        if (last in self.eos_token_ids or last in self.stop_token_ids) and n_out >= self.sampling.min_tokens:
            self.stop_token_id = last
            return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
