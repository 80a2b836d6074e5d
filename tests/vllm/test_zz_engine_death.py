"""Last in the vLLM tier on purpose (file name): kills the session engine's processes.

Only vLLM's own child processes are killed; the session's nats-server and
redis-server (also children of pytest) are left alone.
"""

from __future__ import annotations

import asyncio

import pytest

from gpu_worker.engine import EngineDead
from tests.vllm.test_vllm_engine import collect

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

SPARE = ("nats-server", "redis-server")


async def test_zz_engine_death_raises_engine_dead(vllm_engine, make_item):
    """Last on purpose: kills the session engine's EngineCore process."""
    import psutil  # a vLLM dependency: never skip the test for want of it
    stream = vllm_engine.generate(make_item(prompt="hello", max_tokens=200))
    await stream.__anext__()
    for child in psutil.Process().children(recursive=True):
        if child.name() not in SPARE:
            child.kill()  # the engine-core (and worker) processes vLLM started for us
    with pytest.raises(EngineDead):
        async with asyncio.timeout(60):
            async for _ in stream:
                pass
    with pytest.raises(EngineDead):
        await collect(vllm_engine, make_item(prompt="hello", max_tokens=2))
    with pytest.raises(EngineDead):
        vllm_engine.load()
