"""Small test helpers shared across tiers."""

from __future__ import annotations

import asyncio
import inspect


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
