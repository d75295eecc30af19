"""LoRA adapters on the layers that own their weights: reading and checking PEFT adapter folders, the
adapter slot each q/k/v/o and gate/up/down layer gains, and the pool that moves adapters from a host LRU
into ``max_loras`` device slots (asynchronously on CUDA) and tells a step's tokens which slot they read.

A slot holds, per layer, every output slice's down-projection ``A`` (``[slots, S, R, K]``, zero-padded to
``max_lora_rank``), the up-projections ``B`` stacked along the layer's outputs (``[slots, N, R]``) and each
slice's scale (alpha / r, or alpha / sqrt(r) for rsLoRA). Under tensor parallelism a column layer's
``B`` is split with its outputs and a row layer's ``A`` with its inputs: the partial products of a row
layer join its partial sums, so the all-reduce that follows adds them up.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvloom.core.model.linear import LinearBase
from kvloom.kernels import ops
from kvloom.kernels.lora_reference import segments

# The checkpoint modules an adapter may target (the decoder's own projections).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>A|B)(?:\.[^.]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names the adapter, the value and the limit."""


@dataclass
class AdapterWeights:
    """One adapter read from its folder: per layer prefix, per output slice, ``(A [r, in], B [out, r], scale)``
    at full (unsplit) size on the host. ``digest`` names the weights and config, so KV computed under one
    adapter is only ever reused under the same one."""

    name: str
    path: str
    rank: int
    targets: list[str]
    digest: str
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = field(default_factory=dict)


class LoRAContext:
    """What a forward's adapter slots read: the step's ``LoRABatch`` (None: every token on the base model),
    set by the model from its ``lora`` argument."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRABatch:
    """A step's tokens grouped by adapter slot, on the device (``lora_reference`` names the three arrays);
    ``kept`` is the same for the rows the last layer's MLP keeps, when it keeps fewer. A CUDA graph's batch
    is ``static``: its kernels run whatever the buffers hold at replay."""

    def __init__(self, sorted_tokens: torch.Tensor, seg_start: torch.Tensor, seg_slot: torch.Tensor,
                 spans: list[tuple[int, int, int]], static: bool = False, kept: "LoRABatch | None" = None) -> None:
        self.sorted_tokens, self.seg_start, self.seg_slot = sorted_tokens, seg_start, seg_slot
        self.spans = spans  # (slot, start, end) in sorted_tokens, from the host: the reference's groups
        self.static = static
        self.kept = kept
        self._groups: list[tuple[int, torch.Tensor]] | None = None

    @property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        if self._groups is None:
            self._groups = [(slot, self.sorted_tokens[lo:hi].long()) for slot, lo, hi in self.spans]
        return self._groups


def host_segments(token_slots: np.ndarray, max_loras: int) -> tuple[tuple[np.ndarray, ...], list[tuple[int, int, int]]]:
    """The three arrays of a ``LoRABatch`` on the host, and its (slot, start, end) spans."""
    arrays = segments(token_slots, max_loras)
    _, seg_start, seg_slot = arrays
    spans = [(int(s), int(seg_start[g]), int(seg_start[g + 1])) for g, s in enumerate(seg_slot) if s >= 0]
    return arrays, spans


class LayerLoRA:
    """The adapter slots of one linear layer (its ``lora``); ``apply`` adds the step's LoRA terms to its output."""

    def __init__(self, layer: LinearBase, context: LoRAContext, max_loras: int, max_rank: int,
                 kept_rows: bool = False) -> None:
        self.layer, self.context, self.kept_rows = layer, context, kept_rows
        tp = layer.tp_size
        self.in_full = layer.input_size * (tp if layer.parallel == "row" else 1)
        self.out_full = [s * (tp if layer.parallel == "column" else 1) for s in layer.output_sizes]
        starts = np.cumsum([0, *layer.output_sizes[:-1]]).tolist()
        self.slices = [(int(a), int(n)) for a, n in zip(starts, layer.output_sizes)]
        dev, dtype = layer_device(layer), layer.params_dtype
        self.rank = max_rank
        self.a = torch.zeros(max_loras, len(self.slices), max_rank, layer.input_size, dtype=dtype, device=dev)
        self.b = torch.zeros(max_loras, layer.output_size, max_rank, dtype=dtype, device=dev)
        self.scale = torch.zeros(max_loras, len(self.slices), dtype=torch.float32, device=dev)
        self.targeted: set[int] = set()  # slots whose adapter targets this layer (the others hold zeros)

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.context.batch
        if batch is None:
            return y
        if self.kept_rows and batch.kept is not None:
            batch = batch.kept
        if not batch.static and not any(slot in self.targeted for slot, _, _ in batch.spans):
            return y  # no adapter of this step targets this layer (a graph runs the kernels regardless)
        return ops.lora_add(y, x, self.a, self.b, self.scale, self.slices, batch)

    def share(self, weights: dict[int, tuple[torch.Tensor, torch.Tensor, float]] | None, pin: bool):
        """This rank's slot contents for an adapter's weights of this layer: ``A``, ``B`` padded to the slot
        rank and the scales, on the host; None for a layer the adapter does not target."""
        if not weights:
            return None
        layer = self.layer
        a = torch.zeros(len(self.slices), self.rank, layer.input_size, dtype=layer.params_dtype)
        b = torch.zeros(layer.output_size, self.rank, dtype=layer.params_dtype)
        scale = torch.zeros(len(self.slices), dtype=torch.float32)
        for s, (wa, wb, sc) in weights.items():
            r = wa.shape[0]
            if layer.parallel == "row" and layer.tp_size > 1:
                wa = wa.narrow(1, layer.tp_rank * layer.input_size, layer.input_size)
            if layer.parallel == "column" and layer.tp_size > 1:
                n = self.slices[s][1]
                wb = wb.narrow(0, layer.tp_rank * n, n)
            a[s, :r] = wa
            start, n = self.slices[s]
            b[start:start + n, :r] = wb
            scale[s] = sc
        if pin:
            a, b, scale = a.pin_memory(), b.pin_memory(), scale.pin_memory()
        return a, b, scale

    def copy_in(self, slot: int, share) -> None:
        if share is None:  # not targeted: zeros, and the layer skips the slot
            self.targeted.discard(slot)
            for t in (self.a, self.b, self.scale):
                t[slot].zero_()
            return
        a, b, scale = share
        self.targeted.add(slot)
        self.a[slot].copy_(a, non_blocking=True)
        self.b[slot].copy_(b, non_blocking=True)
        self.scale[slot].copy_(scale, non_blocking=True)


def layer_device(layer: LinearBase) -> torch.device:
    return next((p.device for p in layer.parameters(recurse=False)), torch.device("cpu"))


def lora_layers(model) -> dict[str, LinearBase]:
    """The model's layers an adapter can target, by prefix: those whose checkpoint modules are ``TARGET_MODULES``."""
    stacked = getattr(model, "stacked", {})
    names = {stacked[m][0] if m in stacked else m for m in TARGET_MODULES}
    return {layer.prefix: layer for layer in model.linear_layers() if layer.prefix.rpartition(".")[2] in names}


# --- reading adapters -------------------------------------------------------------------------------
def read_adapter(name: str, path: str, model, max_rank: int) -> AdapterWeights:
    """Read a PEFT adapter folder and check it against ``model``; LoRAError naming what is wrong."""
    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {str(folder)!r} is not a folder (a PEFT adapter folder holds "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {str(config_file)!r} is missing")
    if not weights_file.is_file():
        pickled = (folder / "adapter_model.bin").exists()
        note = " (adapter_model.bin is not read: pickled weights are refused)" if pickled else ""
        raise LoRAError(f"LoRA adapter {name!r}: {str(weights_file)!r} is missing{note}")
    config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    try:
        config = json.loads(config_bytes)
    except ValueError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    _check_config(name, config)
    try:
        from safetensors.torch import load as load_safetensors

        tensors = load_safetensors(weights_bytes)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault, named as such
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read: {e}") from None
    digest = hashlib.sha256(hashlib.sha256(config_bytes).digest() + weights_bytes).hexdigest()
    adapter = AdapterWeights(name, str(folder), 0, [], digest)
    pairs = _pairs(name, tensors)
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    layers = lora_layers(model)
    stacked = getattr(model, "stacked", {})
    targets = set()
    for module, (wa, wb) in sorted(pairs.items()):
        head, _, leaf = module.rpartition(".")
        if leaf not in TARGET_MODULES:
            raise LoRAError(f"LoRA adapter {name!r}: target module {module!r} is not supported; LoRA applies to "
                            f"{', '.join(TARGET_MODULES)}")
        fused, shard = stacked.get(leaf, (leaf, None))
        layer = layers.get(f"{head}.{fused}")
        if layer is None:
            raise LoRAError(f"LoRA adapter {name!r}: target module {module!r} is not in the model "
                            f"({len(getattr(model, 'layers', []))} layers)")
        slot: LayerLoRA = layer.lora
        s = layer.shard_index(shard)
        r = wa.shape[0]
        if wa.dim() != 2 or wb.dim() != 2 or wb.shape[1] != r:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(wa.shape)} and lora_B "
                            f"{tuple(wb.shape)}, which do not make a rank-r pair ([r, in] and [out, r])")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has rank {r}, over max_lora_rank={max_rank} "
                            "(raise --max-lora-rank)")
        expected_a, expected_b = (r, slot.in_full), (slot.out_full[s], r)
        if tuple(wa.shape) != expected_a or tuple(wb.shape) != expected_b:
            raise LoRAError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(wa.shape)} and lora_B "
                            f"{tuple(wb.shape)}; this model needs {expected_a} and {expected_b} (an adapter "
                            "of another base model?)")
        alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
        scale = float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)
        dtype = layer.params_dtype
        adapter.layers.setdefault(layer.prefix, {})[s] = (wa.to(dtype), wb.to(dtype), scale)
        adapter.rank = max(adapter.rank, r)
        targets.add(leaf)
    adapter.targets = sorted(targets, key=TARGET_MODULES.index)
    return adapter


def _check_config(name: str, config: dict[str, Any]) -> None:
    """Refuse what a PEFT config asks for that this engine would otherwise serve wrongly."""
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type={config.get('peft_type')!r} (only LORA)"),
        (bool(config.get("use_dora")), "use_dora=true (DoRA)"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} (only 'none')"),
        (bool(config.get("lora_bias")), "lora_bias=true"),
        (bool(config.get("modules_to_save")), f"modules_to_save={config.get('modules_to_save')!r}"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out=true"),
        (bool(config.get("layer_replication")), "layer_replication"),
        (bool(config.get("target_parameters")), "target_parameters"),
        (bool(config.get("alora_invocation_tokens")), "alora_invocation_tokens (activated LoRA)"),
        (bool(config.get("trainable_token_indices")), "trainable_token_indices"),
    ]
    for refused, what in refusals:
        if refused:
            raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} asks for {what}, which is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t not in TARGET_MODULES]
        if unknown:
            raise LoRAError(f"LoRA adapter {name!r}: target module {unknown[0]!r} is not supported; LoRA applies "
                            f"to {', '.join(TARGET_MODULES)}")


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight (embedding "
                            "adapters, DoRA magnitudes and biases are not supported)")
        found.setdefault(m.group("module"), {})[m.group("which")] = tensor
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise LoRAError(f"LoRA adapter {name!r}: {module} has no lora_{missing} weight")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _pattern(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's per-module override (``alpha_pattern``): the first key naming the module or a suffix of it."""
    for key, value in (patterns or {}).items():
        if key == module or re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return default


# --- the pool ---------------------------------------------------------------------------------------
@dataclass
class _Pending:
    event: Any  # a CUDA event recorded after the slot's copies
    shares: dict  # the host tensors the copies read, alive until they are done


class LoRAPool:
    """This rank's adapters: a host LRU of prepared slot contents (``max_cpu_loras``), ``max_loras`` device
    slots on the model's layers, and the batches that tell a forward which slot each token reads.

    On CUDA a slot is filled on a side stream that first waits for the work already queued (a step still
    reading the slot's old adapter), so neither the host nor the step waits; ``ready`` says when the copy
    is done, and a step that uses the slot waits for it on the device. Elsewhere a load is done at once."""

    def __init__(self, model, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.model, self.max_loras, self.max_rank, self.max_cpu_loras = model, max_loras, max_rank, max_cpu_loras
        self.context = LoRAContext()
        # The last decoder layer runs its MLP on the kept rows only (DecoderLM.forward's ``keep``).
        mlp = getattr(model.layers[-1], "mlp", None)
        kept = {m.prefix for m in mlp.modules() if isinstance(m, LinearBase)} if mlp is not None else set()
        self.layers: dict[str, LayerLoRA] = {}
        for prefix, layer in lora_layers(model).items():
            layer.lora = self.layers[prefix] = LayerLoRA(layer, self.context, max_loras, max_rank, prefix in kept)
        model.lora_context = self.context
        first = next(iter(self.layers.values()))
        self.device = layer_device(first.layer)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.host: OrderedDict[int, tuple[str, dict]] = OrderedDict()  # adapter id -> (digest, shares)
        self.pending: dict[int, _Pending] = {}
        self.static: LoRABatch | None = None

    # --- adapters ----------------------------------------------------------------------------------
    def read(self, adapter_id: int, name: str, path: str) -> AdapterWeights:
        """Read and check an adapter, keeping this rank's share in the host LRU; returns what was read."""
        adapter = read_adapter(name, path, self.model, self.max_rank)
        self._remember(adapter_id, adapter)
        return adapter

    def prefetch(self, adapter_id: int, name: str, path: str) -> None:
        """Have the adapter in the host LRU (read again if it was let go); LoRAError if it cannot be read."""
        if adapter_id in self.host:
            self.host.move_to_end(adapter_id)
        else:
            self._remember(adapter_id, read_adapter(name, path, self.model, self.max_rank))

    def forget(self, adapter_id: int) -> None:
        self.host.pop(adapter_id, None)

    def _remember(self, adapter_id: int, adapter: AdapterWeights) -> dict:
        shares = {prefix: slot.share(adapter.layers.get(prefix), pin=self.cuda) for prefix, slot in self.layers.items()}
        self.host[adapter_id] = (adapter.digest, shares)
        self.host.move_to_end(adapter_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return shares

    def load(self, slot: int, adapter_id: int, name: str, path: str) -> None:
        """Fill device slot ``slot`` with the adapter (read again from ``path`` if the LRU let it go)."""
        self.prefetch(adapter_id, name, path)
        shares = self.host[adapter_id][1]
        if not self.cuda:
            for prefix, layer in self.layers.items():
                layer.copy_in(slot, shares[prefix])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for prefix, layer in self.layers.items():
                layer.copy_in(slot, shares[prefix])
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[slot] = _Pending(event, shares)

    def ready(self, slot: int) -> bool:
        pending = self.pending.get(slot)
        if pending is None:
            return True
        if pending.event.query():
            del self.pending[slot]
            return True
        return False

    def wait_for(self, slots) -> None:
        """Make the device's next work wait for the loads of ``slots`` still in flight (host not blocked)."""
        for slot in slots:
            pending = self.pending.get(slot)
            if pending is not None:
                torch.cuda.current_stream(self.device).wait_event(pending.event)

    def wait_any(self) -> None:
        """Block the host until one pending load is done: an engine with nothing else to run waits here
        instead of spinning."""
        if self.pending:
            next(iter(self.pending.values())).event.synchronize()

    # --- batches -----------------------------------------------------------------------------------
    def host_arrays(self, token_slots: np.ndarray, keep: np.ndarray | None):
        """The host arrays of a step's batch (three per grouping: every row, and the kept rows when the
        last layer keeps some) and their spans, or None when no token reads an adapter."""
        if not (token_slots >= 0).any():
            return None
        arrays, spans = host_segments(token_slots, self.max_loras)
        kept = host_segments(token_slots[keep], self.max_loras) if keep is not None else None
        return arrays, spans, kept

    def make_batch(self, tensors: list[torch.Tensor], spans, kept_spans) -> LoRABatch:
        """A batch from ``host_arrays``' arrays once on the device (three, or six with the kept rows)."""
        kept = LoRABatch(*tensors[3:6], kept_spans) if kept_spans is not None else None
        batch = LoRABatch(*tensors[:3], spans, kept=kept)
        self.wait_for({s for s, _, _ in spans})
        return batch

    def static_batch(self, max_tokens: int) -> LoRABatch:
        """The buffers a CUDA graph's kernels read (empty segments until a replay fills them)."""
        if self.static is None or self.static.sorted_tokens.shape[0] < max_tokens:
            dev = self.device
            self.static = LoRABatch(torch.zeros(max_tokens, dtype=torch.int32, device=dev),
                                    torch.zeros(self.max_loras + 1, dtype=torch.int32, device=dev),
                                    torch.full((self.max_loras,), -1, dtype=torch.int32, device=dev), [], static=True)
        return self.static
