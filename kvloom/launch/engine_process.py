"""The engine's process: ``python -m kvloom.launch.engine_process --address ADDR``, with the launch settings
as JSON on stdin (``{"engine": {...EngineConfig...}, "server": {...ServerConfig...}}``); it serves the
engine loop (``kvloom.core.engine.process``) over the engine ``kvloom.builder`` assembles."""

from __future__ import annotations

import argparse
import sys

from kvloom.launch.child_process import start_child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvloom-engine")
    parser.add_argument("--address", required=True)
    args, engine, server = start_child(parser, argv)
    from kvloom.core.worker.cpu_threads import prepare_openmp

    prepare_openmp()  # before torch loads OpenMP (the builder imports it), which reads its settings then
    from kvloom.builder import build_engine
    from kvloom.core.engine.process import serve_engine
    from kvloom.frontends.admission import engine_gate

    return serve_engine(engine, args.address, server.served_model_name, server.engine_heartbeat_interval,
                        args.engine_secret, engine_gate(server), build=build_engine)


if __name__ == "__main__":
    sys.exit(main())
