"""Per-tenant rate limits in Redis, with atomic Lua scripts (DESIGN.md section 7).

Two token buckets per (tenant, class) -- requests/min and tokens/min -- live in one
Redis hash. Admission *reserves* the estimate (prompt estimate + max_tokens) in one
script call; the actual usage, read later from the ``<PREFIX>_USAGE`` stream, is
*settled* against that reservation exactly once per request id (``SET NX`` on a
settled key inside the same script, so a redelivered usage record or a second settler
is a no-op). Overage (actual > reserved) is charged as debt -- the token bucket goes
negative -- but the debt is capped (``max_debt_minutes`` of the tenant's tokens/min),
so one runaway request cannot lock a tenant out for hours.

The limiter's time is Redis's ``TIME``, so several streamers with skewed clocks share
one view of every bucket.

Redis down => the limiter **fails open** to a local, approximate, in-process copy of
the same buckets (each process enforces the limits alone, so N streamers admit up to
N times the limit; the buckets are `fairlane.ratelimit_local.LocalBuckets`): a blind
limiter must not become an outage. Each fail-open decision is counted
(``fairlane_ratelimit_failopen_total``) and the transition is logged; after
``retry_interval_s`` the next call tries Redis again, and the limiter recovers on its
own when Redis answers.

Fairness does not depend on any of this: DRR accounting lives in the dispatcher.

    limiter = RateLimiter.from_url("redis://...")
    d = await limiter.admit("acme", RateLimits(60, 100_000), est_tokens=300, request_id=rid)
    if not d.allowed: reply 429 with Retry-After: ceil(d.retry_after_ms / 1000)
    ...
    await limiter.refund("acme", rid)          # never published: give the reservation back
    await limiter.settle(usage)                # done by UsageSettler from FL_USAGE
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from prometheus_client import Counter, Gauge
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from fairlane.protocol import ProtocolError, Usage, decode_usage
from fairlane.ratelimit_local import Decision, LocalBuckets, RateLimits
from fairlane.runtime import cancel_and_wait
from fairlane.subjects import Subjects

__all__ = ["Decision", "LocalBuckets", "RateLimiter", "RateLimits", "UsageSettler"]

log = structlog.get_logger(__name__)

FAILOPEN_TOTAL = Counter(
    "fairlane_ratelimit_failopen_total",
    "Rate-limit operations answered by the local fallback because Redis was unavailable",
    ["op"],
)
DEGRADED = Gauge(
    "fairlane_ratelimit_degraded", "1 while the rate limiter is failing open (Redis down)"
)
DECISIONS_TOTAL = Counter(
    "fairlane_ratelimit_decisions_total", "Admission decisions", ["tenant", "result"]
)
SETTLED_TOTAL = Counter(
    "fairlane_ratelimit_settled_total",
    "Usage records settled against reservations",
    ["outcome"],  # settled | duplicate | degraded
)

# KEYS: 1 bucket hash, 2 reservation key
# ARGV: 1 requests/min (0 = unlimited), 2 tokens/min (0 = unlimited), 3 estimate,
#       4 reservation ttl s, 5 bucket ttl ms
# Returns {allowed(0/1), retry_after_ms, tokens_level_after}
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rcap = tonumber(ARGV[1])
local tcap = tonumber(ARGV[2])
local est = tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local r = tonumber(h[1])
local tok = tonumber(h[2])
local ts = tonumber(h[3])
if r == nil then r = rcap end
if tok == nil then tok = tcap end
if ts == nil then ts = now end
local dt = math.max(0, now - ts)
if rcap > 0 then r = math.min(rcap, r + dt * rcap / 60000.0) end
if tcap > 0 then
  tok = math.min(tcap, tok + dt * tcap / 60000.0)
  -- a request larger than a whole minute's budget may still run when the bucket is full
  if est > tcap then est = tcap end
end
local wait = 0
if rcap > 0 and r < 1 then wait = math.max(wait, (1 - r) * 60000.0 / rcap) end
if tcap > 0 and tok < est then wait = math.max(wait, (est - tok) * 60000.0 / tcap) end
local allowed = 0
if wait <= 0 then
  allowed = 1
  if rcap > 0 then r = r - 1 end
  if tcap > 0 then tok = tok - est end
  redis.call('SET', KEYS[2], est, 'EX', tonumber(ARGV[4]))
end
redis.call('HSET', KEYS[1], 'r', r, 't', tok, 'ts', now, 'rcap', rcap, 'tcap', tcap)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return {allowed, math.ceil(wait), math.floor(tok)}
"""

# KEYS: 1 bucket hash, 2 reservation key, 3 settled marker
# ARGV: 1 actual tokens, 2 refund the request slot (0/1), 3 settled-marker ttl s,
#       4 max debt in minutes of tokens/min, 5 bucket ttl ms
# Returns {settled(0 = duplicate, 1 = settled), delta charged}
_SETTLE_LUA = """
if not redis.call('SET', KEYS[3], '1', 'NX', 'EX', tonumber(ARGV[3])) then
  return {0, 0}
end
local reserved = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('DEL', KEYS[2])
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'ts', 'rcap', 'tcap')
if h[2] == false then
  -- no bucket (expired: the tenant is idle, so its bucket is full anyway)
  return {1, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = tonumber(h[1])
local tok = tonumber(h[2])
local ts = tonumber(h[3])
local rcap = tonumber(h[4])
local tcap = tonumber(h[5])
local dt = math.max(0, now - ts)
if rcap > 0 then r = math.min(rcap, r + dt * rcap / 60000.0) end
local delta = 0
if tcap > 0 then
  tok = math.min(tcap, tok + dt * tcap / 60000.0)
  delta = tonumber(ARGV[1]) - reserved
  tok = tok - delta
  local floor = -tcap * tonumber(ARGV[4])
  if tok < floor then tok = floor end
  if tok > tcap then tok = tcap end
end
if tonumber(ARGV[2]) == 1 and rcap > 0 then r = math.min(rcap, r + 1) end
redis.call('HSET', KEYS[1], 'r', r, 't', tok, 'ts', now)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[5]))
return {1, delta}
"""


class RateLimiter:
    """Redis-backed admission control that fails open to `LocalBuckets`.

    ``klass`` separates independent budgets of one tenant (the streamer uses the pool,
    so a tenant's budget on a big model does not share a bucket with a small one);
    the usage settler reads it from ``Usage.pool``.
    """

    def __init__(
        self,
        redis: Redis | None,
        *,
        key_prefix: str = "fl",
        retry_interval_s: float = 1.0,
        max_debt_minutes: float = 1.0,
        reservation_ttl_s: int = 3600,
        settled_ttl_s: int = 86_400,
        op_timeout_s: float = 0.5,
    ) -> None:
        self._redis = redis
        self._prefix = key_prefix
        self._retry_interval_s = retry_interval_s
        self._max_debt_minutes = max_debt_minutes
        self._reservation_ttl_s = reservation_ttl_s
        self._settled_ttl_s = settled_ttl_s
        self._op_timeout_s = op_timeout_s
        # Debt can reach max_debt_minutes below zero; a bucket refills in one minute.
        self._bucket_ttl_ms = int((2 + max_debt_minutes) * 60_000)
        self._local = LocalBuckets()
        self._down_until = 0.0
        self._degraded = False
        self._admit_script = redis.register_script(_ADMIT_LUA) if redis is not None else None
        self._settle_script = redis.register_script(_SETTLE_LUA) if redis is not None else None

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RateLimiter:
        timeout = float(kwargs.get("op_timeout_s", 0.5))
        # No client-side retries: a dead Redis must cost one short timeout, not seconds.
        redis = Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )
        return cls(redis, **kwargs)

    @property
    def degraded(self) -> bool:
        return self._degraded

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    # --- keys ---------------------------------------------------------------------

    def _bucket_key(self, tenant: str, klass: str) -> str:
        # {tenant} hash tag: a tenant's keys share a Redis Cluster slot.
        return f"{self._prefix}:rl:{{{tenant}}}:{klass}"

    def _resv_key(self, tenant: str, request_id: str) -> str:
        return f"{self._prefix}:rl:{{{tenant}}}:resv:{request_id}"

    def _settled_key(self, tenant: str, request_id: str) -> str:
        return f"{self._prefix}:rl:{{{tenant}}}:settled:{request_id}"

    # --- Redis availability ---------------------------------------------------------

    def _redis_usable(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._down_until

    def _on_redis_error(self, op: str, exc: BaseException) -> None:
        self._down_until = time.monotonic() + self._retry_interval_s
        if not self._degraded:
            self._degraded = True
            DEGRADED.set(1)
            log.warning("ratelimit_fail_open", op=op, error=repr(exc))

    def _on_redis_ok(self) -> None:
        if self._degraded:
            self._degraded = False
            DEGRADED.set(0)
            log.info("ratelimit_recovered")

    async def _run(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        # register_script's Script re-loads itself on NOSCRIPT (a restarted Redis).
        try:
            return await asyncio.wait_for(script(keys=keys, args=args), self._op_timeout_s)
        except NoScriptError:  # pragma: no cover - handled by Script, kept for safety
            return await asyncio.wait_for(script(keys=keys, args=args), self._op_timeout_s)

    # --- API ----------------------------------------------------------------------

    async def admit(
        self,
        tenant: str,
        limits: RateLimits,
        est_tokens: int,
        request_id: str,
        klass: str = "default",
    ) -> Decision:
        """Reserve one request and ``est_tokens`` tokens, or say when to retry."""
        if limits.unlimited:
            return Decision(True)
        est = max(0, int(est_tokens))
        key = self._bucket_key(tenant, klass)
        if self._redis_usable():
            try:
                allowed, retry_ms, _ = await self._run(
                    self._admit_script,
                    [key, self._resv_key(tenant, request_id)],
                    [
                        limits.requests_per_min,
                        limits.tokens_per_min,
                        est,
                        self._reservation_ttl_s,
                        self._bucket_ttl_ms,
                    ],
                )
            except (RedisError, OSError, TimeoutError) as exc:
                self._on_redis_error("admit", exc)
            else:
                self._on_redis_ok()
                d = Decision(bool(allowed), int(retry_ms))
                DECISIONS_TOTAL.labels(tenant, "allowed" if d.allowed else "limited").inc()
                return d
        FAILOPEN_TOTAL.labels("admit").inc()
        d = self._local.admit(key, limits, est, request_id, time.monotonic() * 1000)
        DECISIONS_TOTAL.labels(tenant, "allowed_local" if d.allowed else "limited_local").inc()
        return d

    async def settle(self, usage: Usage) -> bool | None:
        """Charge actual usage against the reservation, once per request id.

        Returns True when settled now, False for a duplicate, None when Redis is down
        (settled locally only; the caller should retry later so Redis sees it).
        """
        actual = usage.prompt_tokens + usage.completion_tokens
        return await self._settle(usage.tenant, usage.pool or "default", usage.request_id, actual, False)

    async def refund(self, tenant: str, request_id: str, klass: str = "default") -> bool | None:
        """Give back a reservation whose request was never published (e.g. queue full)."""
        return await self._settle(tenant, klass, request_id, 0, True)

    async def _settle(
        self, tenant: str, klass: str, request_id: str, actual: int, refund: bool
    ) -> bool | None:
        key = self._bucket_key(tenant, klass)
        local_now = time.monotonic() * 1000
        if self._redis_usable():
            try:
                done, _ = await self._run(
                    self._settle_script,
                    [key, self._resv_key(tenant, request_id), self._settled_key(tenant, request_id)],
                    [
                        actual,
                        1 if refund else 0,
                        self._settled_ttl_s,
                        self._max_debt_minutes,
                        self._bucket_ttl_ms,
                    ],
                )
            except (RedisError, OSError, TimeoutError) as exc:
                self._on_redis_error("settle", exc)
            else:
                self._on_redis_ok()
                # Keep the local copy roughly in step for the next outage.
                self._local.settle(key, request_id, actual, refund, self._max_debt_minutes, local_now)
                SETTLED_TOTAL.labels("settled" if done else "duplicate").inc()
                return bool(done)
        FAILOPEN_TOTAL.labels("settle").inc()
        self._local.settle(key, request_id, actual, refund, self._max_debt_minutes, local_now)
        SETTLED_TOTAL.labels("degraded").inc()
        return None


class UsageSettler:
    """A durable JetStream consumer on ``<PREFIX>_USAGE`` that settles each record.

    Acks a record only once Redis has it (settled or duplicate); while Redis is down it
    naks with a delay, so the record is settled exactly once when Redis returns. Several
    streamers share one durable consumer: each record goes to one of them, and the
    settled marker makes a redelivery harmless anyway.
    """

    def __init__(
        self,
        js: Any,
        subjects: Subjects,
        limiter: RateLimiter,
        *,
        durable: str = "ratelimit-settler",
        batch: int = 256,
        fetch_timeout_s: float = 1.0,
        nak_delay_s: float = 1.0,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self._limiter = limiter
        self._durable = durable
        self._batch = batch
        self._fetch_timeout_s = fetch_timeout_s
        self._nak_delay_s = nak_delay_s
        self._task: asyncio.Task | None = None
        self._sub: Any = None
        self.num_settled = 0

    async def start(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        self._sub = await self._js.pull_subscribe(
            self._subjects.usage_all(),
            durable=self._durable,
            stream=self._subjects.usage_stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.NEW,
                ack_wait=30,
                max_ack_pending=10_000,
            ),
        )
        self._task = asyncio.create_task(self._loop(), name="usage-settler")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection may already be closed
                pass
            self._sub = None

    async def _loop(self) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        while True:
            try:
                msgs = await self._sub.fetch(self._batch, timeout=self._fetch_timeout_s)
            except (TimeoutError, NatsTimeout):
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("usage_fetch_failed", error=repr(exc))
                await asyncio.sleep(self._fetch_timeout_s)
                continue
            for msg in msgs:
                await self._handle(msg)

    async def _handle(self, msg: Any) -> None:
        try:
            usage = decode_usage(msg.data)
        except ProtocolError as exc:
            log.warning("usage_malformed", error=exc.message)
            await msg.term()
            return
        result = await self._limiter.settle(usage)
        if result is None:
            await msg.nak(delay=self._nak_delay_s)
            return
        self.num_settled += 1
        await msg.ack()
