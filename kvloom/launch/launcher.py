"""``engine`` serving: starts the engine process and the frontend processes, watches them, and shuts
them down in order on SIGTERM (frontends drain first, then the engine). No process outlives it."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from kvloom.core.config import ConfigError, EngineConfig
from kvloom.frontends.config import LOOPBACK, ServerConfig, zmq_address_is_loopback
from kvloom.launch.child_process import launch_payload
from kvloom.launch.served_models import ServedModel

logger = logging.getLogger("kvloom")

POLL_S = 0.1
ENGINE_STOP_TIMEOUT_S = 30.0
RAY_CHECK_INTERVAL_S = 2.0
HTTP_BACKLOG = 2048  # uvicorn's default, which each worker sets again when it starts serving


def exposed_binds(server: ServerConfig) -> list[str]:
    """A warning for each socket this launch binds beyond loopback (HTTP, engine, gateway)."""
    warnings = []
    if not server.is_loopback:
        warnings.append(f"Listening on {server.host}: the API is reachable from the network"
                        + ("" if server.api_key or server.api_keys else " without an API key"))
    gateway_keys = "it requires an API key" if server.gateway_keys_required else "it has no API key"
    for name, what in (("engine_address", "the engine (frontends authenticate with a per-launch secret)"),
                       ("gateway", f"the ZMQ gateway ({gateway_keys})")):
        address = getattr(server, name)
        if address is not None and not zmq_address_is_loopback(address):
            warnings.append(f"{name}={address} binds beyond loopback: {what} is reachable from the network")
    return warnings


def bind_http_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on the HTTP port in the launcher, before any model loads, so a busy port fails at
    once and every worker shares one socket. Listening at once matters: two sockets with SO_REUSEADDR may
    both bind a port that neither listens on, so a second server started while the first loads would
    bind too and then serve nothing. Connections made before a worker is ready wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(HTTP_BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror} (is another server using port {port}?)") from e
    sock.set_inheritable(True)
    return sock


# --- the launcher ----------------------------------------------------------------------------------
class Launcher:
    """Parent of the engine process and of every frontend process."""

    def __init__(self, engine: EngineConfig, server: ServerConfig, log_level: str = "info",
                 models: list[ServedModel] | None = None) -> None:
        self.engine_config = engine
        self.server_config = server
        self.models = models  # several served models, each with its own engines; None: the one model
        self.log_level = log_level
        self.engines: list[subprocess.Popen] = []  # the data-parallel replicas, in order
        self.frontends: list[subprocess.Popen] = []
        self.signals: list[int] = []
        self.engine_lost = False
        self.engine_restarts = 0
        self.engine_specs: list[tuple] = []  # each engine's spawn arguments, to restart it as it was started
        self.engines_lost: set[int] = set()
        self.stop_for_lost_engine = False  # a model has no engine left and none will be restarted
        self.ray_replicas = None  # RayReplicas when ray_address is set: the engines are Ray actors
        self._next_ray_check = 0.0
        # Frontends prove they belong to this launch with it, so no other local process can drive the
        # engine over TCP; it travels on the children's stdin, never in argv.
        self.engine_secret = secrets.token_hex(32)

    def _spawn(self, module: str, args: list[str], pass_fds: tuple[int, ...] = (),
               env: dict[str, str] | None = None, payload: bytes | None = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--log-level", self.log_level],
            stdin=subprocess.PIPE, pass_fds=pass_fds, env=env,
        )
        proc.stdin.write(payload or launch_payload(self.engine_config, self.server_config, self.engine_secret))
        proc.stdin.close()
        return proc

    def run(self) -> int:
        cfg = self.server_config
        for warning in exposed_binds(cfg):
            logger.warning(warning)
        sock = bind_http_socket(cfg.host, cfg.port)
        self._catch_signals()
        private_dir = tempfile.mkdtemp(prefix="kvloom-")  # mode 0700: only this user reaches the sockets
        if cfg.api_workers > 1 and cfg.responses_store_path is None:
            # Each worker must find the responses another one stored (previous_response_id, GET).
            cfg = self.server_config = cfg.replace(responses_store_path=os.path.join(private_dir, "responses.sqlite"))
        try:
            addresses = self._start_engines(private_dir)
            engine_args = [arg for address in addresses for arg in ("--engine-address", address)]
            payload = None
            if self.models is not None:  # every frontend serves every model
                payload = launch_payload(self.engine_config, cfg, self.engine_secret, self.model_table)
            fd = str(sock.fileno())
            metrics_env = api_worker_env(private_dir)
            for _ in range(cfg.api_workers):
                self.frontends.append(self._spawn("kvloom.frontends.api_server", [*engine_args, "--fd", fd],
                                                  (sock.fileno(),), metrics_env, payload))
            if cfg.gateway:
                self.frontends.append(self._spawn("kvloom.frontends.gateway",
                                                  [*engine_args, "--address", cfg.gateway], payload=payload))
            host, port = sock.getsockname()[:2]
            sock.close()  # the workers hold their own copies
            logger.info("Serving the OpenAI API on http://%s:%d with %d worker(s)%s; engine%s at %s", host, port,
                        cfg.api_workers, f" and the ZMQ gateway on {cfg.gateway}" if cfg.gateway else "",
                        "s" if len(addresses) > 1 else "", ", ".join(addresses))
            return self._watch()
        finally:
            sock.close()
            self._stop_all()
            shutil.rmtree(private_dir, ignore_errors=True)

    def _catch_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda signum, frame: self.signals.append(signum))

    def _start_engine(self, args: list[str], env: dict[str, str] | None, payload: bytes | None = None) -> None:
        spec = ("kvloom.launch.engine_process", args, (), env, payload)
        self.engine_specs.append(spec)
        self.engines.append(self._spawn(*spec))

    def _start_engines(self, private_dir: str) -> list[str]:
        """Start every engine (each model's data-parallel replicas); the first model's addresses."""
        cfg = self.server_config
        if cfg.ray_address is not None:
            from kvloom.launch.ray_replicas import RayReplicas

            self.ray_replicas = RayReplicas(
                cfg.ray_address, launch_payload(self.engine_config, cfg, self.engine_secret), cfg.data_parallel_size,
                num_gpus=1.0 if self.engine_config.device == "cuda" else 0.0,
                host=LOOPBACK if cfg.ray_address == "local" else None, log_level=self.log_level)
            addresses = self.ray_replicas.start()
            self._catch_signals()  # ray.init installs its own SIGTERM handler (exit at once): drain instead
            logger.info("%d engine replica(s) run as Ray actors (%s)", len(addresses), cfg.ray_address)
            return addresses
        if self.models is None:
            addresses = engine_addresses(cfg, private_dir)
            for replica, address in enumerate(addresses):
                self._start_engine(["--address", address], replica_env(self.engine_config, replica, len(addresses)))
            return addresses
        self.model_table = []
        for j, model in enumerate(self.models):
            addresses = [f"ipc://{private_dir}/engine-m{j}-{i}.sock" for i in range(cfg.data_parallel_size)]
            payload = launch_payload(model.engine, cfg.replace(served_model_name=model.name), self.engine_secret)
            for replica, address in enumerate(addresses):
                self._start_engine(["--address", address], replica_env(model.engine, replica, len(addresses)),
                                   payload)
            self.model_table.append({**model.to_dict(), "addresses": addresses})
        return self.model_table[0]["addresses"]

    def _watch(self) -> int:
        while True:
            if self.signals:
                logger.info("Got %s: draining in-flight requests", signal.Signals(self.signals[0]).name)
                return self._shutdown()
            self._check_engine()
            if self.stop_for_lost_engine:
                self._shutdown()  # the frontends have ended the lost engine's requests with a 503
                return 1
            exited = [p for p in self.frontends if p.poll() is not None]
            if exited:
                codes = [p.returncode for p in exited]
                logger.error("A frontend process exited (code %s); stopping the server", codes[0])
                self._shutdown()
                return 1
            time.sleep(POLL_S)

    def _check_engine(self) -> None:
        codes = [engine.poll() for engine in self.engines]
        if self.ray_replicas is not None and self.ray_replicas.actors and time.monotonic() >= self._next_ray_check:
            self._next_ray_check = time.monotonic() + RAY_CHECK_INTERVAL_S  # each check is a round trip
            codes = self.ray_replicas.exit_codes()
        for replica, code in enumerate(codes):
            if code is None or replica in self.engines_lost:
                continue
            if self.server_config.restart_engine and not self.signals and self.ray_replicas is None:
                # The frontends keep their sockets: they reconnect to the new engine and serve again.
                self.engine_restarts += 1
                logger.error("Engine %d exited with code %s (its error is above); restarting it (restart %d)",
                             replica, code, self.engine_restarts)
                self.engines[replica] = self._spawn(*self.engine_specs[replica])
                continue
            self.engines_lost.add(replica)
            self.engine_lost = True
            if self._unservable(replica):
                # Without restart_engine nothing here brings it back: exit, so that a supervisor
                # (systemd, Kubernetes) restarts the server instead of it answering 503 for ever.
                self.stop_for_lost_engine = True
                logger.error("The engine process%s exited with code %s (its error is above); stopping the server "
                             "(exit code 1) so that its supervisor restarts it (restart_engine = true restarts "
                             "the engine instead)", "" if len(codes) == 1 else f" {replica}", code)
            else:
                logger.error("Engine replica %d exited with code %s (its error is above); the other replicas "
                             "serve on, /health reports degraded", replica, code)

    def _unservable(self, replica: int) -> bool:
        """Whether losing ``replica`` leaves its model with no engine at all."""
        per_model = len(self.engine_specs) // len(self.models) if self.models else len(self.engine_specs)
        if per_model == 0:  # Ray actors: one model, no spawn specs
            per_model = self.server_config.data_parallel_size
        first = replica - replica % per_model
        return all(r in self.engines_lost for r in range(first, first + per_model))

    def _shutdown(self) -> int:
        """Frontends first (they stop accepting and finish their requests), then the engine."""
        self._check_engine()  # an engine lost just before the signal still makes the exit non-zero
        drain = self.server_config.drain_timeout
        for p in self.frontends:
            _signal(p, signal.SIGTERM)
        self._wait(self.frontends, drain + 10.0)
        for engine in self.engines:
            _signal(engine, signal.SIGTERM)
        self._wait(self.engines, ENGINE_STOP_TIMEOUT_S)
        if self.ray_replicas is not None:
            self.ray_replicas.stop()
        return 1 if self.engine_lost else 0

    def _wait(self, procs: list[subprocess.Popen], timeout: float) -> None:
        """Wait for ``procs`` to exit; a second signal or the timeout kills them."""
        seen = len(self.signals)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or len(self.signals) > max(seen, 1):
                for p in procs:
                    _signal(p, signal.SIGKILL)
                for p in procs:
                    p.wait()
                return
            time.sleep(POLL_S)

    def _stop_all(self) -> None:
        for p in [*self.frontends, *self.engines]:
            if p.poll() is None:
                _signal(p, signal.SIGKILL)
                p.wait()
        if self.ray_replicas is not None and self.ray_replicas.actors:
            self.ray_replicas.stop()


def engine_addresses(server: ServerConfig, private_dir: str) -> list[str]:
    """One ZeroMQ address per data-parallel replica (an explicit engine_address allows only one)."""
    if server.engine_address is not None:
        return [server.engine_address]
    if server.data_parallel_size == 1:
        return [f"ipc://{private_dir}/engine.sock"]
    return [f"ipc://{private_dir}/engine-{i}.sock" for i in range(server.data_parallel_size)]


def replica_env(engine: EngineConfig, replica: int, num_replicas: int) -> dict[str, str] | None:
    """Replica ``replica``'s environment: on GPUs it sees only its own device (the i-th of those this
    launch may use); on the CPU the replicas share the cores, so nothing changes."""
    if num_replicas == 1 or engine.device == "cpu":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(num_replicas)]
    if len(devices) < num_replicas:
        raise ConfigError(f"data_parallel_size={num_replicas} needs {num_replicas} GPUs, but "
                          f"CUDA_VISIBLE_DEVICES={visible} names {len(devices)}")
    return {**os.environ, "CUDA_VISIBLE_DEVICES": devices[replica]}


def api_worker_env(private_dir: str) -> dict[str, str]:
    """The API workers' environment: one shared directory for their Prometheus counters, so /metrics
    from any worker serves the totals of all of them."""
    from kvloom.frontends.metrics import MULTIPROC_ENV

    metrics_dir = os.path.join(private_dir, "metrics")
    os.makedirs(metrics_dir, exist_ok=True)
    return {**os.environ, MULTIPROC_ENV: metrics_dir}


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def serve(engine: EngineConfig, server: ServerConfig, log_level: str = "info",
          models: list[ServedModel] | None = None) -> int:
    return Launcher(engine, server, log_level, models).run()
