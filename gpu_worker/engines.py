"""Engine factory: one place that maps ``settings.engine`` to an implementation."""

from __future__ import annotations

from collections.abc import Callable

from fairlane.registry import choose
from gpu_worker.config import WorkerSettings
from gpu_worker.engine import Engine


def _sim(settings: WorkerSettings) -> Engine:
    from gpu_worker.sim.engine import SimEngine

    return SimEngine.from_settings(settings)


def _vllm(settings: WorkerSettings) -> Engine:
    # Imported lazily: vLLM is heavy and absent on simulator-only installs.
    from gpu_worker.vllm_engine import VllmEngine

    return VllmEngine.from_settings(settings)


ENGINES: dict[str, Callable[[WorkerSettings], Engine]] = {"sim": _sim, "vllm": _vllm}


def make_engine(settings: WorkerSettings) -> Engine:
    return choose(ENGINES, settings.engine, "engine")(settings)
