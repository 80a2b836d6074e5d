"""The edge's one path for every transport: authenticate, check, admit, submit.

HTTP and websocket handlers turn their bodies into a `Submission`, call
`Edge.start()` and relay the `RequestStream` it returns. Nothing here knows about
Starlette, so the admission logic is testable without sockets.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from fairlane.protocol import ChatMessage, ErrorCode, ErrorInfo
from fairlane.ratelimit import RateLimiter, RateLimits
from fairlane.tenants import TenantRecord, TenantsFile, TenantsWatcher
from fairlane.validation import RequestLimits
from producer.client import FairlaneClient, RequestError, RequestStream
from streamer import metrics
from streamer.errors import MODEL_NOT_FOUND, EdgeError

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: resolved from the API key, never from the body."""

    tenant: str
    tier: str
    record: TenantRecord | None
    limits: RateLimits


@dataclass(slots=True)
class Submission:
    model: str
    request_id: str | None = None  # chosen by the caller (websocket) or generated
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    priority: int = 0
    ttft_budget_ms: int | None = None
    return_token_ids: bool = False


def estimate_prompt_tokens(sub: Submission) -> int:
    # ~4 characters per token (English BPE); trued up from actual usage at settlement.
    if sub.prompt_token_ids is not None:
        return len(sub.prompt_token_ids)
    chars = len(sub.prompt or "") + sum(len(m.content) for m in sub.messages or ())
    return max(1, (chars + 3) // 4)


class Edge:
    def __init__(
        self,
        client: FairlaneClient,
        limiter: RateLimiter,
        tenants: TenantsWatcher,
        *,
        default_max_tokens: int = 256,
        anonymous_tenant: str = "",
        tenants_reload_s: float = 2.0,
    ) -> None:
        self.client = client
        self.limiter = limiter
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
            raise EdgeError(
                404, MODEL_NOT_FOUND, f"the model {model!r} does not exist", param="model"
            )
        return cfg.request_limits(model, self.client.limits)

    async def start(self, principal: Principal, sub: Submission, endpoint: str) -> RequestStream:
        """Admit and publish; raise `EdgeError` with the reason when refused."""
        limits = self.check_model(principal, sub.model)
        max_tokens = sub.max_tokens if sub.max_tokens is not None else min(
            self.default_max_tokens, limits.max_tokens
        )
        if max_tokens > limits.max_tokens:
            raise EdgeError.invalid(
                f"max_tokens must be between 1 and {limits.max_tokens}, got {max_tokens}",
                param="max_tokens",
            )
        if sub.prompt_token_ids is not None and len(sub.prompt_token_ids) > limits.max_prompt_tokens:
            raise EdgeError(
                400,
                ErrorCode.PROMPT_TOO_LONG.value,
                f"prompt has {len(sub.prompt_token_ids)} tokens, over the limit of "
                f"{limits.max_prompt_tokens}",
                param="prompt",
            )
        request_id = sub.request_id or uuid.uuid4().hex
        est = estimate_prompt_tokens(sub) + max_tokens
        decision = await self.limiter.admit(
            principal.tenant, principal.limits, est, request_id, klass=sub.model
        )
        if not decision.allowed:
            metrics.REQUESTS.labels(principal.tenant, endpoint, "rate_limited").inc()
            raise EdgeError.rate_limited(decision.retry_after_ms)
        try:
            stream = await self.client.submit(
                tenant=principal.tenant,
                pool=sub.model,
                tier=principal.tier,
                prompt=sub.prompt,
                messages=sub.messages,
                prompt_token_ids=sub.prompt_token_ids,
                max_tokens=max_tokens,
                temperature=sub.temperature,
                top_p=sub.top_p,
                stop=sub.stop,
                seed=sub.seed,
                priority=sub.priority,
                ttft_budget_ms=sub.ttft_budget_ms,
                request_id=request_id,
                return_token_ids=sub.return_token_ids,
            )
        except RequestError as exc:
            await self._refund(principal, sub, request_id)
            metrics.REQUESTS.labels(principal.tenant, endpoint, exc.error.code.value).inc()
            raise EdgeError.from_info(exc.error) from None
        except Exception as exc:  # NATS down, timeouts: a 503, never a crash
            await self._refund(principal, sub, request_id)
            metrics.REQUESTS.labels(principal.tenant, endpoint, "unavailable").inc()
            log.warning("submit_failed", tenant=principal.tenant, error=repr(exc))
            raise EdgeError.from_info(
                ErrorInfo.of(ErrorCode.OVERLOADED, "the fleet is unavailable; retry later", 1000)
            ) from None
        metrics.REQUESTS.labels(principal.tenant, endpoint, "accepted").inc()
        return stream

    async def _refund(self, principal: Principal, sub: Submission, request_id: str) -> None:
        if principal.limits.unlimited:
            return
        try:
            await self.limiter.refund(principal.tenant, request_id, klass=sub.model)
        except Exception as exc:  # best effort: the reservation expires anyway
            log.warning("refund_failed", error=repr(exc))


def usage_dict(usage: Any) -> dict | None:
    if usage is None:
        return None
    p, c = int(usage.prompt_tokens), int(usage.completion_tokens)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
