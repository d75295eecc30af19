"""The engine freezes the heap it starts with (the garbage collector no longer scans the model and its
kernels in every full collection), and a later engine's start unfreezes it first, so that an engine dropped
in between, or anything else that became garbage, is still collected."""

from __future__ import annotations

import gc
import weakref


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # freed only by the cycle collector


def test_engine_start_freezes_the_heap_and_the_next_start_collects_what_was_dropped(tiny_llama):
    from kvloom import LLM

    cycle = _Cycle()
    ref = weakref.ref(cycle)
    first = LLM(str(tiny_llama), load_format="dummy", max_num_seqs=4)
    assert gc.get_freeze_count() > 1000  # the model, its modules, this process's imports
    model = weakref.ref(first.engine.runner.model)
    del cycle
    gc.collect()
    assert ref() is not None, "a frozen cycle was collected: the heap was not frozen"
    del first
    second = LLM(str(tiny_llama), load_format="dummy", max_num_seqs=4)
    assert ref() is None, "garbage frozen by the first engine outlived the second engine's start"
    assert model() is None, "the dropped engine's model was not collected"
    out = second.generate([[5, 6, 7]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
