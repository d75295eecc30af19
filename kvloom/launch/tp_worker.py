"""The process of a tensor-parallel worker (rank 1..N-1): ``python -m kvloom.launch.tp_worker --rank R
--store-port P --plan-address ipc://...``, with the engine settings as JSON on stdin."""

from __future__ import annotations

import argparse
import logging
import sys

from kvloom.core.worker.tp_worker import TPWorker
from kvloom.launch.child_process import start_child
from kvloom.plugins.manager import PluginManager

logger = logging.getLogger("kvloom.tp_worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvloom-tp-worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--plan-address", required=True)
    args, engine, _ = start_child(parser, argv)
    from kvloom.core.worker.cpu_threads import prepare_openmp

    prepare_openmp()
    try:
        worker = TPWorker(engine, args.rank, args.store_port, PluginManager.from_config(engine))
        code = worker.serve(args.plan_address)
    except Exception:  # noqa: BLE001 - rank 0 sees this process exit and takes the engine down
        logger.exception("Tensor-parallel rank %d failed", args.rank)
        return 1
    from kvloom.core.model.distributed import destroy_group

    destroy_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
