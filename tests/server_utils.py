"""Running the real ``engine`` server as a subprocess in tests, and looking at its processes through /proc."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """Run this checkout's code in the server, whatever kvloom is installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class EngineServer:
    """``engine ...`` started with ``sys.executable``; logs go to a file shown when start-up fails."""

    def __init__(self, args: list[str], log_dir: Path, port: int | None = None, api_key: str | None = None) -> None:
        self.port = port or free_port()
        self.api_key = api_key
        self.log_path = log_dir / f"engine-{self.port}.log"
        cmd = [sys.executable, "-m", "kvloom.cli", *args]
        if "--port" not in args and "--config" not in args:
            cmd += ["--port", str(self.port)]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=server_env(), cwd=REPO_ROOT, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_with(self, *needles: str, timeout: float = 30.0) -> str:
        """The log once it holds every one of ``needles`` (or after ``timeout``): a request's access line is written
        after its response went out, so the client may read the log first."""
        deadline = time.monotonic() + timeout
        while not all(n in (text := self.log()) for n in needles) and time.monotonic() < deadline:
            time.sleep(0.05)
        return text

    def wait_ready(self, timeout: float = 240.0) -> "EngineServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"engine not healthy within {timeout}s:\n{self.log()}")

    def __enter__(self) -> "EngineServer":
        """``with EngineServer(...) as srv:`` waits until it serves and stops it on the way out, also when
        it never became ready (``__exit__`` does not run when ``__enter__`` raises)."""
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid)

    def child_running(self, module: str) -> int:
        """The pid of the child process running ``python -m module``."""
        for pid in self.descendants():
            if module in cmdline(pid):
                return pid
        raise LookupError(f"no child runs {module}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this test started
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(int(entry.name))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by ``pids``."""
    inodes = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            for fd in fd_dir.iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr_hex, port_hex = cols[1].split(":")
                found.append((_ip(addr_hex, width), int(port_hex, 16)))
    return found


def _ip(addr_hex: str, width: int) -> str:
    raw = bytes.fromhex(addr_hex)
    # /proc/net prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, raw)


def metric_samples(url: str) -> dict[str, float]:
    """A server's /metrics as {sample name: value}: the engine series of every replica summed, other
    labels dropped (the last sample of a name wins: a histogram's ``+Inf`` bucket)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    summed: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, *sorted((k, v) for k, v in s.labels.items() if k not in ("model", "replica")))
            summed[key] = summed.get(key, 0.0) + s.value
    return {key[0]: value for key, value in summed.items()}


def wait_engine_requests(url: str, count: int, timeout: float = 60.0) -> None:
    """Wait until the server's engine holds ``count`` requests (running or waiting): they reached it."""
    deadline = time.monotonic() + timeout
    while True:
        values = metric_samples(url)
        held = values.get("kvloom_num_requests_running", 0) + values.get("kvloom_num_requests_waiting", 0)
        if held >= count:
            return
        assert time.monotonic() < deadline, f"the engine holds {held:g} requests, not {count}, after {timeout:g}s"
        time.sleep(0.05)


def kv_blocks(url: str) -> tuple[float, float]:
    """(free, total) KV blocks of the server's engine."""
    values = metric_samples(url)
    return values["kvloom_kv_cache_free_blocks"], values["kvloom_kv_cache_total_blocks"]


def raw_socket(engine):
    """A DEALER socket registered with an engine (``.address``) as frontend "raw", for tests that
    speak the wire protocol themselves."""
    import zmq

    from kvloom.core import messages as m

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(engine.address)
    sock.send(m.encode(m.RegisterFrontend(frontend_id="raw")))
    assert isinstance(m.decode_engine_message(sock.recv()), m.EngineReady)
    return sock
