"""EngineCore: owns the model, the KV cache and the step loop (propose -> schedule -> run -> update ->
emit). It speaks token ids only; frontends own text. Wire structs are built here, from the plain
values the scheduler and the runner exchange."""

from __future__ import annotations

import atexit
import gc
import logging
import time
from typing import Protocol

import torch

from kvloom.core.config import ConfigError, EngineConfig, resolve_device, resolve_dtype
from kvloom.core.engine import capacity
from kvloom.core.engine.adapters import AdapterSlots
from kvloom.core.engine.gate import AdmissionGate
from kvloom.core.engine.kv_cache import KVCacheManager
from kvloom.core.engine.lora_adapters import LoRAAdapterMethods
from kvloom.core.engine.memory_profile import loaded_draft, profile_free_gpu_memory
from kvloom.core.engine.pooling import PooledSums, check_pooling, resolve_task
from kvloom.core.engine.request import Request, RequestStatus
from kvloom.core.engine.scheduler import Scheduler
from kvloom.core.engine.speculation import Speculator, logits_row_weight
from kvloom.core.engine.step import RunnerOutput, SchedulerOutput
from kvloom.core.engine.structured_output import StructuredOutputManager
from kvloom.core.messages import AddRequest, EngineStats, TokenDelta, TokenLogprobs, TopLogprob
from kvloom.core.model.attention.selector import get_attention_backend
from kvloom.core.model.distributed import check_tp_size, threads_per_rank
from kvloom.core.model.files import resolve_model
from kvloom.core.model.loader import build_model, load_hf_config
from kvloom.core.sampling_params import check_priority
from kvloom.core.worker.cpu_malloc import keep_freed_memory, release_free_memory
from kvloom.core.worker.cpu_threads import ThreadGovernor, available_core_ids, available_cores, configure_threads
from kvloom.core.worker.model_runner import ModelRunner, make_kv_caches

logger = logging.getLogger("kvloom")

STEP_TIME_WEIGHT = 0.2  # of the latest step in the moving average: a few steps, so a burst shows quickly


class RequestRejected(ValueError):
    """A request that can never run (bad tokens, over the context or over the whole KV cache)."""

    error_kind = "rejected"


class UnknownAdapter(RequestRejected):
    """A request naming a LoRA adapter this engine does not serve (any more)."""

    error_kind = "not_found"


GOVERNOR_LAYER_STRIDE = 4  # CPU thread count re-checked before every 4th decoder layer (a clock read)


class EngineParts(Protocol):
    """What an engine is assembled from, made when the engine needs each (the builder above core hands the
    plugin manager): a proposer before any weights load, a weight format for the model, a KV allocator once
    the memory profile has sized the cache, a prefix cache and a scheduling policy."""

    enabled: dict[str, str]  # kind -> plugin name, for the start-up log

    def make_spec_proposer(self, hf_config, config: EngineConfig): ...
    def make_quantization(self, hf_config, config: EngineConfig): ...
    def make_kv_allocator(self, num_blocks: int, config: EngineConfig): ...
    def make_prefix_cache(self, block_size: int, config: EngineConfig): ...
    def make_scheduler_policy(self, config: EngineConfig): ...


class EngineCore(LoRAAdapterMethods):
    def __init__(self, config: EngineConfig, parts: EngineParts, tp_worker_module: str | None = None) -> None:
        """``tp_worker_module``: what ``python -m`` runs for ranks 1..N-1 (needed only with tensor parallelism)."""
        config.validate()
        self.plugins = parts
        self.device = resolve_device(config.device)
        self.config = config = config.for_device(self.device.type)
        self.model_path = resolve_model(config.model)
        self.hf_config = load_hf_config(self.model_path, config.hf_overrides)
        self.dtype = resolve_dtype(config.dtype, self.device, self.hf_config)
        self.max_model_len = self._resolve_max_model_len()
        self.kv_cache_dtype = capacity.kv_cache_dtype(config, self.dtype, self.device)
        self.eos_token_ids = _eos_ids(self.hf_config)
        self.vocab_size = self.hf_config.vocab_size
        # generate, or pool prompts (embed, score) with the model folder's pooling
        self.task, self.pooling_config = resolve_task(config.task, self.model_path, self.hf_config)
        if self.task == "embed":  # no logits: an output projection is neither loaded nor needed (many lack one)
            self.hf_config.tie_word_embeddings = True
        self.pooled = PooledSums()

        check_tp_size(self.hf_config, config.tensor_parallel_size)
        self.thread_governor = None
        if self.device.type == "cpu":
            keep_freed_memory()
            threads = configure_threads(threads_per_rank(config))
            if config.adaptive_threads and config.threads is None and config.tensor_parallel_size == 1 \
                    and available_cores() > 1:
                self.thread_governor = ThreadGovernor(threads, available_core_ids())
        # Before any weights load, so that a bad draft model fails fast.
        self.proposer = proposer = self.plugins.make_spec_proposer(self.hf_config, config)
        # The profile counts what this engine adds from here on, not what others hold.
        self._gpu_start = capacity.gpu_memory_snapshot(self.device) if self.device.type == "cuda" else None
        self.tp_driver = None  # tensor parallelism: this process is rank 0 of the group
        if config.tensor_parallel_size > 1:
            from kvloom.core.worker.tp_executor import TPDriver

            if tp_worker_module is None:
                raise ConfigError("tensor_parallel_size > 1 needs a worker entry point: build the engine with "
                                  "kvloom.builder.build_engine")
            self.tp_driver = TPDriver(config, self.device, tp_worker_module)
        tp = self.tp_driver.tp if self.tp_driver is not None else None
        t0 = time.perf_counter()
        kernels = config.kernels()
        self.attention_backend = get_attention_backend(self.device, kernels)
        self.quantization = self.plugins.make_quantization(self.hf_config, config)  # None: dense
        self.model = build_model(
            self.model_path, self.hf_config, load_format=config.load_format, device=self.device,
            dtype=self.dtype, backend=self.attention_backend, max_positions=self.max_model_len, seed=config.seed,
            quantization=self.quantization, tp=tp, kernels=kernels, gguf_int4=config.gguf_int4,
        )
        logger.info("Loaded %s (%s, %s) in %.1fs", config.model, self.dtype, self.device, time.perf_counter() - t0)
        if hasattr(self.model, "describe_moe"):
            logger.info(self.model.describe_moe())
        if self.thread_governor is not None:
            # Checked inside the forward, every few layers: a long prefill step must not run out its whole
            # length on a team that another process has just started to slow down.
            # The hook holds the governor, not the engine: no cycle keeps a dropped engine's KV cache alive.
            governor = self.thread_governor

            def check_threads(module, args) -> None:  # a pre-hook's return value would replace the inputs
                if not torch.compiler.is_compiling():  # the compiled steps check once, before they run
                    governor.maybe_adjust()

            for layer in list(self.model.layers)[::GOVERNOR_LAYER_STRIDE]:
                layer.register_forward_pre_hook(check_threads)
        if self.quantization is not None:
            logger.info(self.quantization.describe())
        self.lora = None  # the LoRA pool: before the memory profile, so its slots count as weights
        if config.enable_lora:
            from kvloom.core.model.lora import LoRAPool

            self.lora = LoRAPool(self.model, config.max_loras, config.max_lora_rank, config.resolved_max_cpu_loras)
            logger.info("LoRA: %d device slots of rank %d on %d layers; %d adapters kept in host memory",
                        config.max_loras, config.max_lora_rank, len(self.lora.layers), config.resolved_max_cpu_loras)

        draft_kv = getattr(proposer, "allocate_kv", None)
        if draft_kv is not None:  # the draft model's weights and forward count in the memory profile below
            proposer.load(device=self.device, dtype=self.dtype, load_format=config.load_format,
                          max_model_len=self.max_model_len, seed=config.seed,
                          max_num_batched_tokens=config.max_num_batched_tokens, kernels=kernels)
        # Layer groups of the KV cache: sliding layers keep only their windows' blocks (a draft model's cache
        # follows the first group's table).
        self.kv_layout = capacity.kv_layout(config, self.hf_config, draft_model=draft_kv is not None)
        self.capacity = self._kv_capacity()
        if tp is not None:  # every rank holds every block: the group's capacity is its smallest rank's
            self.capacity = self.tp_driver.group_capacity(self.capacity, self.hf_config, self.dtype, self.quantization)
        logger.info(self.capacity.describe())
        layers, kv_heads, head_dim = self.hf_config.num_hidden_layers, self.model.num_kv_heads, self.model.head_dim
        shape = self.attention_backend.kv_cache_shape(self.capacity.num_blocks, config.block_size, kv_heads, head_dim)
        kv_caches = make_kv_caches(layers, shape, self.kv_cache_dtype, self.device, self.kv_layout)
        num_groups = len(self.kv_layout.groups) if self.kv_layout.hybrid else 1
        self.model.kv_groups = self.kv_layout.group_of_layer() if num_groups > 1 else None
        # --- plugins: KV allocator, prefix cache, scheduling policy ---
        self.kv = KVCacheManager(
            self.plugins.make_kv_allocator(self.capacity.num_blocks, config), config.block_size,
            self.plugins.make_prefix_cache(config.block_size, config), self.kv_layout,
        )
        self.adapters = AdapterSlots(config.max_loras, self.lora.ready) if self.lora is not None else None
        self.scheduler = Scheduler(
            self.kv, self.plugins.make_scheduler_policy(config), max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
            adapters=self.adapters,
        )
        self.gate = AdmissionGate()  # no caps or quotas unless the engine process sets them
        if draft_kv is not None:
            draft_kv(self.capacity.num_blocks, config.block_size, config.seed)
        self.speculator = (Speculator(proposer, self.max_model_len, kv=self.kv, logits_weight=logits_row_weight(
            self.hf_config)) if proposer is not None else None)
        logger.info("Plugins: %s", ", ".join(f"{kind}={name}" for kind, name in self.plugins.enabled.items()))
        # --- end of plugins ---
        self.num_expired_in_queue = 0
        self.num_expired_running = 0
        self.step_s = 0.0  # a moving average of the wall time of steps that ran, for queue deadlines
        self.last_step_s = 0.0
        self.async_scheduling = config.async_scheduling == "on" or (
            config.async_scheduling == "auto" and self.device.type == "cuda")
        if self.tp_driver is None:
            self.runner = ModelRunner(self.model, kv_caches, config.block_size, self.device, config.seed, num_groups,
                                      lora=self.lora)
        else:
            from kvloom.core.worker.tp_executor import TPDriverRunner

            self.runner = TPDriverRunner(self.model, kv_caches, config.block_size, self.device, config.seed,
                                         num_groups, driver=self.tp_driver, share_tokens=self.async_scheduling,
                                         lora=self.lora)
        graphs_refusal = getattr(self.model, "cuda_graphs_refusal", lambda: None)()
        if self.device.type == "cuda" and not config.enforce_eager and graphs_refusal:
            logger.info("CUDA graphs off: %s", graphs_refusal)
        elif self.device.type == "cuda" and not config.enforce_eager:
            spec = self.speculator
            self.runner.capture_graphs(config.max_num_seqs, self.max_model_len, *(
                (spec.k + 1, spec.policy.max_batch_size or config.max_num_seqs) if spec is not None else ()))
            if draft_kv is not None:
                proposer.capture_graphs(config.max_num_seqs, self.max_model_len)
        elif self.device.type == "cpu" and not config.enforce_eager and self.tp_driver is None:
            governor = self.thread_governor
            # for the quiet machine's count: each count costs the whole compile again (the guards hold it), and
            # the governor's fewer threads under contention run the step eagerly
            self.runner.compile_cpu_steps(config.max_num_seqs, None if governor is None else governor.maybe_adjust,
                                          torch.get_num_threads() if governor is None else governor.max_threads)
        self.last_step_tokens = 0
        self.num_overlapped_steps = 0  # launched while the previous step was still in flight
        self._in_flight: tuple | None = None  # (plan, launched step, when its step began) not yet resolved
        self._last_done = 0.0  # when the newest step's tokens were applied (perf_counter)
        # Prompt logprobs gathered so far, per request, until its first delta carries them.
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self.structured = StructuredOutputManager(config.model, config.tokenizer, self.vocab_size,
                                                  self.eos_token_ids)
        self.runner.before_sampling = self.structured.fill_bitmasks  # overlaps the forward on a GPU
        for name, path in config.lora_modules.items():
            self.load_lora_adapter(name, path)
        freeze_startup_heap()
        if self.device.type == "cpu":
            release_free_memory()  # the loader's temporaries (dequantized copies, casts) go back now

    # --- set-up ------------------------------------------------------------------------------------
    def _resolve_max_model_len(self) -> int:
        return capacity.resolve_max_model_len(self.hf_config, self.config.max_model_len)

    def _kv_capacity(self) -> capacity.KVCapacity:
        # One function for the engine and ``engine plan``; on CUDA the budget is profiled (only if needed).
        profile = (lambda: profile_free_gpu_memory(self)) if self._gpu_start is not None else None  # on CUDA
        draft = loaded_draft(self)  # its blocks (the target's ids) come out of the same budget
        return capacity.kv_capacity(self.config, self.hf_config, self.dtype, self.max_model_len, profile,
                                    self.config.tensor_parallel_size,
                                    draft.kv_bytes_per_token if draft is not None else 0, self.kv_layout)

    # --- requests ----------------------------------------------------------------------------------
    @property
    def gate(self) -> AdmissionGate:
        return self._gate

    @gate.setter
    def gate(self, gate: AdmissionGate) -> None:
        """The engine process sets its own gate (caps, quotas) after construction: the scheduler's
        callbacks must follow it. They close over the gate, not self: an engine in a reference cycle
        keeps its KV cache (and a GPU's memory) until the garbage collector runs, long after its LLM
        was dropped."""
        self._gate = gate
        self.scheduler.on_first_step = lambda req, now: gate.observe_queue_wait(now - req.arrival_time)
        self.scheduler.on_finish = lambda req: gate.release(req.request_id, req.num_tokens)

    def add_request(self, msg: AddRequest) -> Request:
        """Admit a request or raise RequestRejected naming the value and the limit. Requests are validated
        by the frontends (frontends/validation.py); these are the checks of what crosses the engine's
        socket, whatever sent it: nothing here may crash or corrupt the loop."""
        prompt = msg.prompt_token_ids
        n = len(prompt)
        if n == 0:
            raise RequestRejected("the prompt is empty: at least one token is needed")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad} is out of range [0, {self.vocab_size})")
        bad = next((t for t in msg.sampling.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"stop token id {bad} is out of range [0, {self.vocab_size})")
        bad = next((t for t in msg.sampling.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"logit_bias token id {bad} is out of range [0, {self.vocab_size})")
        try:
            check_priority(msg.priority)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        # The one check of engine-wide id uniqueness: a live id never gets a second request's outputs.
        if msg.request_id in self.scheduler.requests or self.structured.is_pending(msg.request_id):
            raise RequestRejected(f"request id {msg.request_id!r} is already in use")
        try:
            pooling = check_pooling(self.task, self.pooling_config, msg.pooling, self.hf_config.hidden_size,
                                    self.vocab_size)
        except ValueError as e:
            raise RequestRejected(str(e)) from None
        limit = self.max_model_len
        max_tokens = msg.sampling.max_tokens
        if pooling is not None:  # prefill only: the prompt alone must fit
            max_tokens = 1
            if n > limit:
                raise RequestRejected(f"the prompt has {n} tokens, over max_model_len={limit}")
        elif max_tokens is None:
            max_tokens = limit - n
            if max_tokens < 1:
                raise RequestRejected(f"the prompt has {n} tokens, which leaves no room under max_model_len={limit}")
        elif n + max_tokens > limit:
            raise RequestRejected(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds max_model_len={limit}"
            )
        # at its peak: its largest prefill chunk computed with everything before it (sliding layers: their
        # windows' blocks and the chunk's)
        total = n + (max_tokens if pooling is None else 0)  # a pooling request computes its prompt only
        need = self.kv.sequence_blocks(total, min(n, self.config.max_num_batched_tokens))
        if need > self.kv.num_blocks:
            raise RequestRejected(
                f"the request needs {need} KV blocks ({total} tokens) but the whole cache has "
                f"{self.kv.num_blocks} blocks ({self.capacity.num_tokens} tokens)"
            )
        adapter = self._adapter_of(msg.lora_name)  # an unknown adapter is rejected before the gate counts it
        waiting = self.scheduler.waiting
        # Raises gate.Refusal (queue full, over a key's quota): the caller maps it to the client's 429.
        self.gate.admit(msg.request_id, msg.api_key_name, n, max_tokens if pooling is None else 0, len(waiting),
                        sum(r.num_tokens - r.num_computed_tokens for r in waiting))
        req = Request.from_message(msg, eos_token_ids=self.eos_token_ids, max_tokens=max_tokens)
        if adapter is not None:
            req.lora_id, req.lora_name, req.lora_key = adapter.id, adapter.name, adapter.key
        req.pooling, req.pooling_params = pooling, msg.pooling
        if req.sampling.structured is not None and pooling is None:
            self.structured.submit(req)  # scheduled once its grammar is compiled
        else:
            self.scheduler.add_request(req)
        return req

    # --- LoRA adapters -----------------------------------------------------------------------------
    def _adapter_of(self, name: str):
        if not name:
            return None
        if self.adapters is None:
            raise RequestRejected(f"LoRA adapter {name!r} was asked for, but this engine serves none (start it "
                                  "with --enable-lora)")
        adapter = self.adapters.by_name.get(name)
        if adapter is None:
            raise UnknownAdapter(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters.by_name) or 'none'}")
        return adapter

    def abort_requests(self, request_ids: list[str]) -> list[TokenDelta]:
        self.structured.remove(request_ids)
        for rid in request_ids:
            self._prompt_logprobs.pop(rid, None)
        self.pooled.drop(request_ids)
        return [
            TokenDelta(request_id=r.request_id, new_token_ids=[], finish_reason="abort",
                       num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=r.num_cached_tokens)
            for r in self.scheduler.abort(request_ids) + self.structured.drop_pending(request_ids)
        ]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or self.structured.has_pending

    def _schedule_compiled(self) -> list[TokenDelta]:
        """Constrained requests whose grammar is compiled join the scheduler; a grammar that failed to
        compile ends its request as rejected, with the reason."""
        idle = not self.scheduler.has_unfinished() and self._in_flight is None
        ready, failed = self.structured.take_compiled(wait_s=0.01 if idle else 0.0)
        for req in ready:
            self.scheduler.add_request(req)
        return [TokenDelta(request_id=req.request_id, new_token_ids=[], finish_reason="error", error=reason,
                           error_kind="rejected", num_prompt_tokens=req.num_prompt_tokens) for req, reason in failed]

    # --- the loop body -----------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Propose drafts, schedule, run, update, emit. With async scheduling the step is launched and
        the previous one's tokens are returned, so the host's work overlaps the device's."""
        started = time.perf_counter()
        deltas = self._schedule_compiled() if self.structured.has_pending else []
        deltas += [] if self._can_overlap() else self.flush()
        deltas += self._expire()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)
        plan = self.scheduler.schedule()
        if plan.lora_loads:
            deltas += self._read_adapters(plan)
        self._fill_prompt_targets(plan)
        self.last_step_tokens = plan.num_tokens
        if plan.seqs and self._in_flight is not None:
            self.num_overlapped_steps += 1
        launched = self.runner.execute(plan) if plan else None
        if launched is not None:
            self.scheduler.advance(plan)
        deltas += self.flush()
        if not plan.seqs and self.lora is not None:
            self.lora.wait_any()  # nothing runs until an adapter's load is done: wait for it, not in a spin
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = (plan, launched, started)
                self.structured.defer(plan.step_id, launched.fetch)
            else:
                deltas += self._update(plan, launched.fetch())
                self._observe(plan, started)
            self.last_step_s = time.perf_counter() - started
            self.step_s += STEP_TIME_WEIGHT * (self.last_step_s - self.step_s)
        return deltas

    def _expire(self) -> list[TokenDelta]:
        deltas = []
        # A request scheduled now shows its first token after this step, or the next one when steps overlap.
        # A step that just ran long (a burst of prefills) is likely to be followed by another.
        first_token_s = max(self.step_s, self.last_step_s) * (2 if self.async_scheduling else 1)
        for req, kind in self.scheduler.expire(first_token_s):
            self._prompt_logprobs.pop(req.request_id, None)
            self.pooled.drop([req.request_id])
            if kind == "queue_timeout" or req.first_scheduled_time is None:
                self.num_expired_in_queue += 1
                message = "the request waited past its deadline in the queue and never ran"
            else:
                self.num_expired_running += 1
                message = f"the request ran past its deadline after {req.num_output_tokens} tokens"
            deltas.append(TokenDelta(request_id=req.request_id, new_token_ids=[], finish_reason="error",
                                     error=message, error_kind=kind, num_prompt_tokens=req.num_prompt_tokens,
                                     num_cached_tokens=req.num_cached_tokens))
        return deltas

    def flush(self) -> list[TokenDelta]:
        """Wait for the step still in flight (async scheduling) and return its tokens."""
        if self._in_flight is None:
            return []
        plan, launched, started = self._in_flight
        self._in_flight = None
        deltas = self._update(plan, launched.fetch())
        self._observe(plan, started)
        return deltas

    def _observe(self, plan: SchedulerOutput, started: float) -> None:
        """Time a step for the speculator's cost model: from its start (or the previous step's end, when
        it overlapped that one) to its tokens applied, which is the step's share of the wall time."""
        now = time.perf_counter()
        if self.speculator is not None:
            self.speculator.observe(plan.num_tokens, sum(s.num_sample_rows for s in plan.seqs),
                                    now - max(started, self._last_done))
        self._last_done = now

    def _can_overlap(self) -> bool:
        """Penalties need every earlier token on the host, and so does a proposer: such steps wait for
        the previous one. Steps where no request proposes (the adaptive policy backed off, or the batch
        is too large to speculate) overlap as usual."""
        if not self.async_scheduling:
            return False
        if self._in_flight is not None and self._in_flight[0].num_draft_tokens:
            return False  # its rejected drafts roll back tokens that the next plan would build on
        if self.speculator is not None and self.speculator.wants_host_tokens(self.scheduler):
            return False
        # A grammar's next mask needs the token in flight only when the next step samples: the manager
        # takes it then (StructuredOutputManager.defer), so constrained requests overlap like free ones.
        return not any(r.sampling.uses_penalties for r in self.scheduler.running)

    def _fill_prompt_targets(self, plan: SchedulerOutput) -> None:
        """Tell the runner which prompt tokens this step's positions score, for requests that ask for prompt
        logprobs and have not had them yet (a request recomputed after preemption is not scored again)."""
        for s in plan.seqs:
            if s.sampling.prompt_logprobs is None:
                continue
            req = self.scheduler.requests[s.request_id]
            end = min(s.start_pos + s.num_new_tokens, req.num_prompt_tokens - 1)
            done = len(self._prompt_logprobs.get(s.request_id, ()))
            if req.num_output_tokens == 0 and end > done:
                s.prompt_targets = req.all_token_ids[s.start_pos + 1: end + 1]

    def _gather_prompt_logprobs(self, out: RunnerOutput) -> None:
        for rid, p in out.prompt_logprobs.items():
            if rid not in self.scheduler.requests:
                continue  # finished or aborted meanwhile
            got = self._prompt_logprobs.setdefault(rid, [])
            skip = max(0, len(got) + 1 - p.start)  # positions scored again after a preemption
            got.extend(TokenLogprobs(t, lp, [TopLogprob(i, v) for i, v in zip(ids, vals)], rank)
                       for t, lp, rank, ids, vals in list(zip(p.token_ids, p.logprobs, p.ranks, p.top_ids,
                                                             p.top_logprobs))[skip:])

    def _update(self, plan: SchedulerOutput, out: RunnerOutput) -> list[TokenDelta]:
        deltas = []
        if out.prompt_logprobs:
            self._gather_prompt_logprobs(out)
        if out.pooled:
            self.pooled.gather(out.pooled, self.scheduler.requests)
        updates = self.scheduler.resolve(plan, out)
        if self.structured.has_matchers:
            self.structured.accept_step(plan.step_id, {u.request.request_id: u.new_token_ids for u in updates})
        logprobs, prompt_logprobs = out.logprobs, self._prompt_logprobs
        now = self.scheduler.clock()
        for u in updates:
            req = u.request
            first = u.new_token_ids and len(req.output_token_ids) == len(u.new_token_ids)
            if u.finished:
                self.structured.remove([req.request_id])
            prompt_lps = prompt_logprobs.pop(req.request_id, None) if prompt_logprobs else None
            lps = logprobs.get(req.request_id) if logprobs else None
            deltas.append(TokenDelta(
                request_id=req.request_id, new_token_ids=u.new_token_ids,
                finish_reason=u.finished.value if u.finished else None,
                stop_token_id=req.stop_token_id if u.finished is RequestStatus.FINISHED_STOPPED else None,
                logprobs=_wire_logprobs(u.new_token_ids, lps) if lps is not None else None,
                prompt_logprobs=prompt_lps,
                num_prompt_tokens=len(req.prompt_token_ids), num_cached_tokens=req.num_cached_tokens,
                num_draft_tokens=req.num_draft_tokens, num_accepted_tokens=req.num_accepted_tokens,
                prefill_time=now - req.first_scheduled_time if first and req.first_scheduled_time else None,
                embedding=self.pooled.finish(req.request_id, req.pooling, req.pooling_params, self.pooling_config)
                if req.pooling is not None and u.finished else None,
            ))
        return deltas

    def stats(self) -> EngineStats:
        sched, gate = self.scheduler, self.gate.counters
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_free_blocks=self.kv.num_free_blocks(), num_total_blocks=self.kv.num_blocks,
            kv_usage=self.kv.usage(), num_preemptions=sched.num_preemptions,
            prefix_cache_queries=sched.prefix_cache_queries, prefix_cache_hits=sched.prefix_cache_hits,
            step_tokens=self.last_step_tokens, spec_decode_num_drafts=sched.num_draft_tokens,
            spec_decode_num_accepted=sched.num_accepted_tokens, spec_decode_num_steps=sched.num_spec_steps,
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting),
            num_rejected_queue_full=gate.rejected_queue_full, num_rate_limited=dict(gate.rate_limited),
            num_expired_in_queue=self.num_expired_in_queue, num_expired_running=self.num_expired_running,
            queue_wait_buckets=list(gate.queue_wait_buckets), queue_wait_sum=gate.queue_wait_sum,
            **(self._lora_stats() if self.adapters is not None else {}),
        )

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel worker died)."""
        if self.tp_driver is not None:
            self.tp_driver.check_workers()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (an engine of one process has nothing to stop)."""
        if self.tp_driver is not None:
            self.tp_driver.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (e.g. between benchmark runs). False when no prefix cache is enabled or
        while requests are in flight (they hold cached blocks): call again when idle."""
        return self.kv.reset_prefix_cache()


def freeze_startup_heap() -> None:
    """Move every object alive now (the model, its modules and kernels, the graphs) out of the garbage
    collector's sight, as vLLM's engine does: they live as long as the engine, and a full collection
    would scan them all again. On this project's CPU one full collection in the middle of 256 requests
    scanned ~300,000 objects for ~150 ms, a pause of the device; with the heap frozen there was none.
    Objects made later (requests, tokens) are collected as usual. What an earlier engine of this process
    froze is unfrozen first, so an engine dropped since then is collected here."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


atexit.register(gc.unfreeze)  # the interpreter's last collections see everything (a no-op if nothing is frozen)


def _wire_logprobs(tokens: list[int], lps) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, lp, [TopLogprob(i, v) for i, v in zip(ids, vals)])
            for t, lp, ids, vals in zip(tokens, lps.logprobs, lps.top_ids, lps.top_logprobs)]


def _eos_ids(hf_config) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

