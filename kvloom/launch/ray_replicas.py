"""Data-parallel replicas as Ray actors (the ``kvloom[ray]`` extra, ``engine --ray-address ...``): Ray
places one actor per replica (one GPU each on a GPU cluster) and each actor runs an ordinary engine
process on its node, bound to TCP there; the frontends' router connects to them as to local replicas
(with the launch's engine secret). Nothing kvloom-specific runs the cluster: Ray does."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys

from kvloom.core.config import ConfigError

logger = logging.getLogger("kvloom")

ENGINE_STOP_TIMEOUT_S = 30.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("ray_address needs Ray: pip install 'kvloom[ray]'") from None
    return ray


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineReplicaActor:
    """The body of the Ray actor: one engine process, started with the launch payload on its stdin
    (the same start as under the launcher), that dies with the actor."""

    def __init__(self, payload: bytes, host: str | None, log_level: str) -> None:
        import ray

        ip = host or ray.util.get_node_ip_address()
        self._address = f"tcp://{ip}:{_free_port(ip)}"
        self.proc = subprocess.Popen([sys.executable, "-m", "kvloom.launch.engine_process", "--address", self._address,
                                      "--log-level", log_level], stdin=subprocess.PIPE)
        self.proc.stdin.write(payload)
        self.proc.stdin.close()

    def address(self) -> str:
        return self._address

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float = ENGINE_STOP_TIMEOUT_S) -> int:
        """SIGTERM (the engine drains), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class RayReplicas:
    """``num_replicas`` engine actors on the Ray cluster at ``ray_address`` (``local``: a cluster of
    this machine, started here and shut down with the server)."""

    def __init__(self, ray_address: str, payload: bytes, num_replicas: int, *, num_gpus: float = 0.0,
                 host: str | None = None, log_level: str = "info") -> None:
        self.ray = _import_ray()
        self.ray_address = ray_address
        self.payload = payload
        self.num_replicas = num_replicas
        self.num_gpus = num_gpus
        self.host = host
        self.log_level = log_level
        self.actors: list = []

    def start(self) -> list[str]:
        """Start the actors; their engines' addresses (the engines may still be loading)."""
        ray = self.ray
        if not ray.is_initialized():
            if self.ray_address == "local":
                ray.init(include_dashboard=False, logging_level=logging.WARNING)
            else:
                ray.init(address=self.ray_address, logging_level=logging.WARNING)
        actor = ray.remote(num_cpus=0, num_gpus=self.num_gpus)(EngineReplicaActor)
        self.actors = [actor.remote(self.payload, self.host, self.log_level) for _ in range(self.num_replicas)]
        return ray.get([a.address.remote() for a in self.actors])

    def exit_codes(self) -> list[int | None]:
        """Each replica's engine exit code (None while it runs; -1 when its actor is gone)."""
        codes = []
        for a in self.actors:
            try:
                codes.append(self.ray.get(a.exit_code.remote(), timeout=10))
            except Exception:  # noqa: BLE001 - a dead actor or node: the replica is lost
                codes.append(-1)
        return codes

    def stop(self) -> None:
        ray = self.ray
        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=ENGINE_STOP_TIMEOUT_S + 10)
        except Exception as e:  # noqa: BLE001 - the actors are killed below either way
            logger.warning("Stopping the Ray replicas: %s", e)
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self.ray_address == "local":
            ray.shutdown()
