"""The interfaces of the quantization and speculative-decoding plugin kinds (docs/plugins.md).

The other three kinds have their interfaces beside the code that uses them:
``kvloom.core.engine.scheduler.SchedulingPolicy``, ``kvloom.core.engine.kv_cache.BlockAllocator`` and
``kvloom.core.engine.kv_cache.PrefixCache``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from kvloom.core.engine.request import Request
    from kvloom.core.model.linear import LinearMethod


class QuantizationMethod(Protocol):
    """A weight format: how checkpoint tensors become layer parameters and how a linear layer runs.

    The model builds every projection as a layer class of ``kvloom.core.model.linear`` (replicated,
    merged column, QKV, row); the method gives each one its ``LinearMethod``, which declares the
    parameters (packed weights, scales, zero points: the loader requires every one of them), repacks
    them once after loading and runs the matmul. ``kvloom.core.model.quantization.QuantizationMethod``
    is a base class that keeps ``modules_to_not_convert`` layers dense.
    """

    name: str

    def linear_method(self, prefix: str, checkpoint_prefixes: Sequence[str]) -> "LinearMethod":
        """The method of the layer at ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``), which loads
        the checkpoint modules ``checkpoint_prefixes`` (``...q_proj``, ``...k_proj``, ``...v_proj``)."""
        ...

    def describe(self) -> str:
        """One start-up log line: the format, bits, group size and the kernel that runs it."""
        ...


class DraftProposer(Protocol):
    """Proposes draft tokens for speculative decoding; the engine verifies them with the target model
    (greedy: a draft token is kept while it equals the target's argmax; sampling: rejection sampling,
    which keeps the target distribution exactly)."""

    name: str
    num_speculative_tokens: int

    def propose(self, requests: Sequence["Request"]) -> dict[str, list[int]]:
        """Up to ``num_speculative_tokens`` draft tokens per request id, for requests that are decoding
        (every known token but the newest is computed). Called before each step on the engine's host
        side; the requests are read-only here. A request may be left out or get fewer tokens (the
        engine also cuts drafts to the request's remaining ``max_tokens`` and ``max_model_len``);
        ``request.all_token_ids`` holds the prompt and every accepted token.

        A proposer may carry a ``policy`` attribute (``kvloom.core.engine.speculation.SpeculationPolicy``)
        for the adaptive no-regression policy; without one the defaults apply."""
        ...
