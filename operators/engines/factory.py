"""Which class runs an engine name: 'hf', 'vllm' or 'module:Class' (an engine of one's own), in its
call-synchronous form (`make_engine`, a RolloutEngine) or its in-flight form (`make_in_flight_engine`, an
InFlightEngine for a RolloutLoop). Apart from base.py so that the interface imports none of its
implementations; the engine modules (torch, vLLM) are imported only when their engine is made."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from operators.engines.base import InFlightEngine, RolloutEngine


def engine_class(name: str):
    """The class an engine name names: "module:Class" (an engine of one's own, e.g. the benchmarks'
    simulator, benchmarks/sim_engine.py), imported here."""
    module, _, attribute = name.partition(":")
    if not module or not attribute:
        raise ValueError(f"unknown rollout engine {name!r}; use 'hf', 'vllm' or 'module:Class'")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rollout engine {name!r} cannot be imported ({err}); check the module path "
                         "(importable from the working directory) and the class name") from None


def make_engine(name: str, model_path: str, **options) -> RolloutEngine:
    """'hf', 'vllm', or 'module:Class' (any class with RolloutEngine's methods, built as
    Class(model_path, **options))."""
    if name == "hf":
        from operators.engines.hf import HFEngine

        return HFEngine(model_path, **options)
    elif name == "vllm":
        from operators.engines.vllm import VLLMEngine

        return VLLMEngine(model_path, **options)
    return engine_class(name)(model_path, **options)


def has_in_flight_form(name: str) -> bool:
    """Whether engine `name` can keep many requests in flight (InFlightEngine): vLLM, or an engine class
    that implements `stream`."""
    if name in ("hf", "vllm"):
        return name == "vllm"
    return hasattr(engine_class(name), "stream")


def make_in_flight_engine(name: str, model_path: str, **options) -> InFlightEngine:
    """The in-flight form of engine `name`, for a RolloutLoop (operators/engines/rollout.py)."""
    if name == "vllm":
        from operators.engines.vllm_async import AsyncVLLMEngine

        return AsyncVLLMEngine(model_path, **options)
    if not has_in_flight_form(name):
        raise ValueError(f"rollout engine {name!r} has no in-flight form (call-synchronous only); "
                         "use vllm, an engine class with `stream`, or rollout.in_flight: false")
    return engine_class(name)(model_path, **options)
