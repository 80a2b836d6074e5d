"""Small test helpers shared across tiers."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any

from fairlane.protocol import InferenceRequest, SamplingParams
from producer.spec import RequestSpec

_SAMPLING = frozenset(SamplingParams.__struct_fields__)


async def wait_until(pred, timeout_s: float = 10.0, interval_s: float = 0.01) -> None:
    """Wait until `pred()` (sync or async) is true, or fail after `timeout_s`.

    Only for state that lives in another process or in the server (stream lengths,
    a subprocess's effect), where there is no event to await.
    """
    async with asyncio.timeout(timeout_s):
        while True:
            ok = pred()
            if inspect.isawaitable(ok):
                ok = await ok
            if ok:
                return
            await asyncio.sleep(interval_s)  # noqa: ASYNC110 - polling external state


def _nest_sampling(fields: dict[str, Any]) -> dict[str, Any]:
    knobs = {k: fields.pop(k) for k in list(fields) if k in _SAMPLING}
    if knobs:
        fields["sampling"] = SamplingParams(**knobs)
    return fields


def spec(**fields: Any) -> RequestSpec:
    """A `RequestSpec` from flat keywords (``max_tokens=4`` goes into ``sampling``)."""
    return RequestSpec(**_nest_sampling(fields))


def request(**fields: Any) -> InferenceRequest:
    """An `InferenceRequest` from flat keywords (``max_tokens=4`` goes into ``sampling``)."""
    return InferenceRequest(**_nest_sampling(fields))


@contextlib.asynccontextmanager
async def in_process_fleet(nats_url: str, nc: Any, uid: str, *, time_scale: float,
                           pool: str = "p") -> AsyncIterator[tuple[Any, Any]]:
    """A dispatcher, one simulated worker and a producer client in this event loop,
    on their own subject prefix; yields (client, subjects). Stops all of it after."""
    from dispatcher.config import DispatcherSettings
    from dispatcher.service import Dispatcher
    from fairlane.poolconfig import SchedulerConfig
    from fairlane.subjects import Subjects
    from gpu_worker.config import WorkerSettings
    from gpu_worker.engines import make_engine
    from gpu_worker.service import Worker
    from producer.client import FairlaneClient

    subjects = Subjects(f"t{uid}")
    dispatcher = Dispatcher(
        DispatcherSettings(nats_url=nats_url, prefix=subjects.prefix, pool=pool),
        SchedulerConfig(policy="drr"),
    )
    await dispatcher.start()
    ws = WorkerSettings(nats_url=nats_url, prefix=subjects.prefix, pool=pool,
                       worker_id=f"w-{uid}", time_scale=time_scale, max_num_seqs=8,
                       heartbeat_ms=200)
    stop = asyncio.Event()
    worker_task = asyncio.create_task(Worker(ws, make_engine(ws)).run(stop))
    client = FairlaneClient(nc, prefix=subjects.prefix)
    await client.start()
    try:
        yield client, subjects
    finally:
        await client.close()
        stop.set()
        assert await asyncio.wait_for(worker_task, 30) == 0
        await dispatcher.stop()
