"""Small test helpers shared across tiers."""

from __future__ import annotations

import asyncio
import inspect
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
