"""The edge's one path for every transport: authenticate, pick the pool, submit.

HTTP and websocket handlers decode their bodies (`streamer.schema`), call
`Edge.start()` and relay the `RequestStream` it returns. Validation, rate-limit
admission and publishing are the producer library's (`FairlaneClient.submit`), the
same path the producer CLI takes. Nothing here knows about Starlette.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from fairlane.errors import ErrorCode
from fairlane.ratelimit import RateLimits
from fairlane.tenants import TenantRecord, TenantsFile, TenantsWatcher
from fairlane.validation import RequestLimits
from producer.client import FairlaneClient, RequestError, RequestSpec, RequestStream
from streamer import metrics
from streamer.errors import EdgeError

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: resolved from the API key, never from the body."""

    tenant: str
    tier: str
    record: TenantRecord | None
    limits: RateLimits


class EdgeBody(Protocol):
    """A decoded request body (`streamer.schema`) that maps itself to a `RequestSpec`."""

    def to_spec(self, *, tenant: str, tier: str, pool: str,
                default_max_tokens: int) -> RequestSpec: ...


class Edge:
    def __init__(
        self,
        client: FairlaneClient,
        tenants: TenantsWatcher,
        *,
        default_max_tokens: int = 256,
        anonymous_tenant: str = "",
        tenants_reload_s: float = 2.0,
    ) -> None:
        self.client = client  # its limiter applies the tenants' rate limits
        self.tenants = tenants
        self.default_max_tokens = default_max_tokens
        self.anonymous_tenant = anonymous_tenant
        self._reload_s = tenants_reload_s
        self._next_reload = 0.0
        self._bg: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` detached (e.g. an upstream Cancel from a handler being cancelled)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def aclose(self) -> None:
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)

    @property
    def config(self) -> TenantsFile:
        now = time.monotonic()
        if now >= self._next_reload:
            self._next_reload = now + self._reload_s
            self.tenants.maybe_reload()
        return self.tenants.current

    def models(self) -> list[str]:
        return sorted(self.config.pools)

    def authenticate(self, authorization: str | None) -> Principal:
        cfg = self.config
        if not authorization:
            if self.anonymous_tenant:
                tier = cfg.default_tier(next(iter(cfg.pools)))
                rec = cfg.tenant(self.anonymous_tenant)
                return Principal(
                    self.anonymous_tenant,
                    rec.tier if rec else tier,
                    rec,
                    RateLimits.of(rec) if rec else RateLimits(),
                )
            raise EdgeError.unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise EdgeError.unauthorized("malformed Authorization header: expected 'Bearer <key>'")
        rec = cfg.lookup_key(key.strip())
        if rec is None:
            raise EdgeError.unauthorized("invalid API key")
        return Principal(rec.name, rec.tier, rec, RateLimits.of(rec))

    def check_model(self, principal: Principal, model: str) -> RequestLimits:
        cfg = self.config
        if model not in cfg.pools or (
            principal.record is not None and not principal.record.allows_pool(model)
        ):
            raise EdgeError(f"the model {model!r} does not exist", ErrorCode.MODEL_NOT_FOUND,
                            param="model")
        return cfg.request_limits(model, self.client.limits)

    async def start(self, principal: Principal, body: EdgeBody, endpoint: str,
                    model: str, *, request_id: str | None = None,
                    traceparent: str | None = None) -> RequestStream:
        """Map `body` for `model` and submit it as `principal`; raise a
        `FairlaneError` (an `EdgeError` or the library's `RequestError`) when refused.
        `request_id`: the id to run it under (the HTTP answer's ``X-Request-Id``; None:
        a fresh one); `traceparent`: its W3C trace context (None or invalid: a fresh one)."""
        try:
            limits = self.check_model(principal, model)
            spec = body.to_spec(tenant=principal.tenant, tier=principal.tier, pool=model,
                                default_max_tokens=min(self.default_max_tokens,
                                                       limits.max_tokens))
        except EdgeError as exc:  # refused before submitting: counted here too
            metrics.request(principal.tenant, endpoint, exc.code.value)
            raise
        if request_id is not None:
            spec.request_id = request_id
        try:
            stream = await self.client.submit(spec, rate_limits=principal.limits, limits=limits,
                                              traceparent=traceparent)
        except RequestError as exc:
            metrics.request(principal.tenant, endpoint, exc.code.value)
            raise
        except Exception as exc:  # NATS down, timeouts: a 503, never a crash
            metrics.request(principal.tenant, endpoint, "unavailable")
            log.warning("submit_failed", tenant=principal.tenant, error=repr(exc))
            raise EdgeError("the fleet is unavailable; retry later", ErrorCode.OVERLOADED,
                            retry_after_ms=1000) from None
        metrics.request(principal.tenant, endpoint, "accepted")
        return stream


def usage_dict(usage: Any) -> dict | None:
    if usage is None:
        return None
    p, c = int(usage.prompt_tokens), int(usage.completion_tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
