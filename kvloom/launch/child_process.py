"""The start of every child process of ``engine`` (engine, API workers, gateway): die with the launcher,
parse the flags, and read the launch settings from stdin. Neutral ground, so a child never imports the
launcher."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from typing import Any

from kvloom.core.config import EngineConfig
from kvloom.frontends.config import ServerConfig


def bind_to_parent() -> None:
    """Die with the parent (Linux): a launcher killed with SIGKILL must not leave an engine behind."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def read_launch_payload() -> dict[str, Any]:
    """The launch settings a child gets as JSON on stdin (so an API key never shows in ``ps``)."""
    return json.loads(sys.stdin.read() or "{}")


def start_child(parser: argparse.ArgumentParser, argv: list[str] | None
                ) -> tuple[argparse.Namespace, EngineConfig, ServerConfig]:
    """The common start of every child process: parse its flags (plus ``--log-level``), set up logging,
    die with the launcher, and read the engine and serving settings from stdin."""
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    bind_to_parent()
    payload = read_launch_payload()
    args.engine_secret = payload.get("engine_secret")
    args.models = payload.get("models")  # several served models: [{"name", "engine", "addresses"}]
    return args, EngineConfig(**payload["engine"]), ServerConfig(**payload.get("server", {}))


def launch_payload(engine: EngineConfig, server: ServerConfig, engine_secret: str | None = None,
                   models: list[dict[str, Any]] | None = None) -> bytes:
    payload: dict[str, Any] = {"engine": dataclasses.asdict(engine), "server": dataclasses.asdict(server)}
    if models is not None:
        payload["models"] = models
    if engine_secret is not None:
        payload["engine_secret"] = engine_secret
    return json.dumps(payload).encode()
