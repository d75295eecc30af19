"""The interfaces of the quantization and speculative-decoding plugin kinds. The engine runs
speculative-decoding proposers; quantization is specified (kvloom.plugins.hookspecs) so plugins can be
written against it, and enabling one fails at start-up until the loader calls it (docs/plugins.md).

The other three kinds have their interfaces beside the code that uses them:
``kvloom.core.scheduler.SchedulingPolicy``, ``kvloom.core.kv_cache.BlockAllocator`` and
``kvloom.core.kv_cache.PrefixCache``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from kvloom.core.request import Request


class QuantizationMethod(Protocol):
    """A weight format: how checkpoint tensors become layer parameters and how a linear layer runs.

    The model builds every projection through a linear factory (``kvloom.core.models.llama.LinearFactory``);
    a quantization method is that factory plus a pass after loading.
    """

    name: str

    def make_linear(self, in_features: int, out_features: int, bias: bool, prefix: str) -> "torch.nn.Module":
        """The layer for one projection (``prefix`` is its parameter path, e.g. ``layers.0.self_attn.qkv_proj``).
        Its parameters are named so that the checkpoint's tensors for it load by name (packed weights,
        scales, zero points), and its ``forward(x)`` computes ``x @ W.T + b`` in this format."""
        ...

    def process_weights_after_loading(self, model: "torch.nn.Module") -> None:
        """Repack or transpose loaded weights for the kernels, once, after every tensor is loaded."""
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
