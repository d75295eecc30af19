"""Tensor parallelism in the engine process: it is rank 0 and starts ranks 1..N-1 as worker processes
(``kvloom.core.worker.tp_worker``, started by ``kvloom.launch.tp_worker``). The scheduler runs once, here; each step's ``SchedulerOutput`` goes
to every worker msgpack-encoded over an ``ipc://`` ZeroMQ socket, every rank runs the forward (the
model's collectives keep them in step) and rank 0 alone samples.

Rank 0 lives in the engine process rather than in a worker of its own: the plan and the sampled tokens
stay in the process that owns them (no extra hop per step), and a 2-way CPU run needs two processes,
not three. The plans go over ZeroMQ rather than a collective because an idle engine sends none for as
long as it likes, while a collective would time out.

A dead worker ends the engine: every step checks the workers first, a collective with a dead peer
raises (gloo) or times out (the group's timeout), and a watchdog thread exits the process if a step is
still stuck in one some seconds after a worker died."""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import torch
import zmq

from kvloom.core.config import EngineConfig
from kvloom.core.engine.step import SchedulerOutput
from kvloom.core.model.distributed import (
    COLLECTIVE_TIMEOUT_S,
    STORE_HOST,
    WORKER_ENV,
    TensorParallel,
    destroy_group,
    init_group,
)
from kvloom.core.worker.model_runner import LaunchedStep, ModelRunner, batch_order
from kvloom.core.worker.sampler import prompt_logits_slices

logger = logging.getLogger("kvloom")

STARTUP_TIMEOUT_S = 300.0  # workers import torch and load their shard; a loaded CI machine is slow
WATCHDOG_GRACE_S = 10.0  # a step still running this long after a worker died is stuck in a collective
STEP, STOP = b"step", b"stop"
# The driver of this process, until shut down: an engine that failed to start after its workers did
# (a bad checkpoint, say) leaves one behind, which the next start in the same process stops first.
_live: list["TPDriver"] = []


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process exited: the engine cannot run another step."""


def worker_address(directory: str, rank: int) -> str:
    return f"ipc://{directory}/tp-rank{rank}.sock"


class TPDriver:
    """Rank 0's side of the group: starts and watches the workers and sends them each step's plan."""

    def __init__(self, config: EngineConfig, device: torch.device, worker_module: str) -> None:
        import torch.distributed as dist

        for stale in list(_live):
            stale.shutdown()
        self.size = config.tensor_parallel_size
        self.device = device
        self.procs: list[subprocess.Popen] = []
        self.dir = tempfile.mkdtemp(prefix="kvloom-tp-")  # mode 0700: only this user reaches the sockets
        self.ctx = zmq.Context()
        self.sockets = []
        self._in_step_since: float | None = None
        self._closed = False
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore(STORE_HOST, 0, self.size, True, timeout=timeout, wait_for_workers=False)
        for rank in range(1, self.size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # plans queue until the worker reads them; none is dropped
            sock.bind(worker_address(self.dir, rank))
            self.sockets.append(sock)
        payload = json.dumps({"engine": dataclasses.asdict(config)}).encode()  # the settings every rank shares
        env = {**os.environ, **WORKER_ENV}
        for rank in range(1, self.size):
            args = [sys.executable, "-m", worker_module, "--rank", str(rank),
                    "--store-port", str(store.port), "--plan-address", worker_address(self.dir, rank),
                    "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()]
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, env=env)
            proc.stdin.write(payload)
            proc.stdin.close()
            self.procs.append(proc)
        atexit.register(self.shutdown)
        _live.append(self)
        try:
            self._wait_for_workers(store)
            self.tp = init_group(0, self.size, store.port, device, store=store)
        except BaseException:
            self.shutdown()
            raise
        self._store = store
        self._watchdog = threading.Thread(target=self._watch, name="kvloom-tp-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("Tensor parallel: %d ranks (%s), workers pid %s", self.size, "nccl" if device.type == "cuda"
                    else "gloo", ", ".join(str(p.pid) for p in self.procs))

    def _wait_for_workers(self, store) -> None:
        """Each worker sets its key once it reached the store; a worker that dies first is reported at
        once, not after the group's timeout."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in range(1, self.size):
            while not store.check([f"kvloom/ready/{rank}"]):
                self.check_workers()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel worker rank {rank} did not start within "
                                       f"{STARTUP_TIMEOUT_S:.0f}s")
                time.sleep(0.1)

    def group_capacity(self, cap, hf_config, dtype, quantization):
        """The KV capacity every rank can hold (the smallest rank's blocks), logged with rank 0's share
        of the weights as ``engine plan`` computes them."""
        import dataclasses

        from kvloom.core.model.loader import weight_bytes

        blocks = self.tp.min_int(cap.num_blocks, self.device)
        share = weight_bytes(hf_config, dtype, quantization, self.device.type, TensorParallel(0, self.size))
        logger.info("Tensor parallel: %d ranks; per rank: %d bytes of weights (%.2f GiB), %d KV bytes/token",
                    self.size, share, share / 2**30, cap.bytes_per_token)
        return dataclasses.replace(cap, num_blocks=blocks)

    # --- health ------------------------------------------------------------------------------------
    def dead_workers(self) -> list[tuple[int, subprocess.Popen]]:
        return [(rank, p) for rank, p in enumerate(self.procs, 1) if p.poll() is not None]

    def check_workers(self) -> None:
        dead = self.dead_workers()
        if dead:
            rank, proc = dead[0]
            raise WorkerDied(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                             f"{proc.returncode}; the engine cannot run without it")

    def explain(self, error: Exception, wait_s: float = 2.0) -> None:
        """A collective failed: if a worker died (its exit may take a moment to be seen), say so."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.dead_workers():
                try:
                    self.check_workers()
                except WorkerDied as died:
                    raise died from error
            time.sleep(0.05)

    def _watch(self) -> None:
        died_at = None
        while not self._closed:
            time.sleep(0.5)
            if died_at is None and self.dead_workers():
                died_at = time.monotonic()
            since = self._in_step_since
            if died_at is not None and since is not None and time.monotonic() - max(died_at, since) > WATCHDOG_GRACE_S:
                rank, proc = self.dead_workers()[0]
                logger.error("Tensor-parallel worker rank %d (pid %d) exited with code %s and the engine is stuck "
                             "in a collective with it: exiting", rank, proc.pid, proc.returncode)
                os._exit(1)

    # --- steps -------------------------------------------------------------------------------------
    def send_plan(self, plan: SchedulerOutput) -> None:
        data = msgspec.msgpack.encode(plan)
        for sock in self.sockets:
            sock.send_multipart([STEP, data])

    def step_started(self) -> None:
        self._in_step_since = time.monotonic()

    def step_ended(self) -> None:
        self._in_step_since = None

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then SIGKILL for any still running) and leave the group."""
        if self._closed:
            return
        self._closed = True
        if self in _live:
            _live.remove(self)
        for sock in self.sockets:
            try:
                sock.send_multipart([STOP], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sock in self.sockets:
            sock.close()
        self.ctx.term()
        destroy_group()
        shutil.rmtree(self.dir, ignore_errors=True)


class TPDriverRunner(ModelRunner):
    """Rank 0's runner: sends the plan to the workers, then runs and samples as on one device. Under async
    scheduling the sampled tokens go to every rank too (the next step's placeholder inputs)."""

    def __init__(self, *args, driver: TPDriver, share_tokens: bool, **kw) -> None:
        super().__init__(*args, **kw)
        self.driver = driver
        self.share_tokens = share_tokens

    def execute(self, plan: SchedulerOutput) -> LaunchedStep:
        self.driver.check_workers()
        self.driver.send_plan(plan)
        self.driver.step_started()
        try:
            launched = super().execute(plan)
            if self.share_tokens and launched.sample is not None:
                with torch.inference_mode():
                    self.driver.tp.broadcast(launched.sample.tokens)
        except Exception as e:
            self.driver.explain(e)
            raise
        finally:
            self.driver.step_ended()
        return launched


class TPWorkerRunner(ModelRunner):
    """A worker rank's runner: the same inputs and forward as rank 0 (so the collectives pair up, CUDA
    graphs included), no sampling. Under async scheduling it takes rank 0's sampled tokens."""

    def __init__(self, *args, tp: TensorParallel, share_tokens: bool, **kw) -> None:
        super().__init__(*args, **kw)
        self.tp = tp
        self.share_tokens = share_tokens

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> None:
        if plan.lora_loads:
            self.load_adapters(plan.lora_loads)
        seqs = plan.seqs
        if not seqs:
            return
        # Rank 0 runs a step that scores prompt tokens eagerly (graphs keep no prompt positions): so does this one.
        num_scored = sum(len(s.prompt_targets) for s in seqs if s.prompt_targets)
        pooling = [s for s in batch_order(seqs) if s.pooling is not None]  # eager on rank 0 too
        if (not num_scored and not pooling and self.graphs and len(seqs) <= self._max_graph_batch
                and all(s.num_new_tokens == 1 for s in seqs)):
            _, sampling = self._replay(seqs)
        else:
            ids, pos, meta, rows, sampling, lora = self.prepare(seqs)
            hidden = self.model(ids, pos, meta, self.kv_caches, keep=rows, lora=lora)
            # Each logits all-gather pairs with one of rank 0's: the scored prompt rows first, in
            # score_prompt's slices, then the sampled rows. Only rank 0 reads the logits.
            for rows in prompt_logits_slices(num_scored):
                self.model.compute_logits(hidden[rows])
            row = num_scored
            for s in pooling:  # a scorer's logits, in PooledStates' order
                row += s.pooling.rows(s.start_pos, s.num_new_tokens, s.num_sample_rows > 0)[1]
                if s.pooling.score_token_ids and s.num_sample_rows:
                    self.model.compute_logits(hidden[row - 1: row])
            if sampling:
                self.model.compute_logits(hidden[row:])
        if not sampling:
            self._prev_tokens, self._prev_rows = None, {}
            return
        if self.share_tokens:
            rows = sum(s.num_sample_rows for s in sampling)
            self._prev_tokens = self.tp.broadcast(torch.empty(rows, dtype=torch.int64, device=self.device))
            self._prev_rows = {}
            row = 0
            for s in sampling:
                self._prev_rows[s.request_id] = row + s.num_sample_rows - 1
                row += s.num_sample_rows
