"""kvloom: a pure-PyTorch LLM inference engine built from plugins."""

from kvloom.core.config import EngineConfig
from kvloom.core.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; frontends import this package without them.
    if name == "LLM":
        from kvloom.core.worker.cpu_threads import prepare_openmp

        prepare_openmp()  # before torch loads OpenMP, which reads its settings then
        from kvloom.llm import LLM

        return LLM
    raise AttributeError(name)
