"""`python -m producer`: stream one request to the terminal, or generate load.

    python -m producer --tenant acme --prompt "hi" --max-tokens 64
    python -m producer --tenant acme --count 200 --concurrency 16
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import nats
import nats.errors

from fairlane.logs import configure_logging
from fairlane.natsauth import SERVICE_USER_PREFIX
from fairlane.natsconn import read_password
from fairlane.ratelimit import RateLimiter, RateLimits
from fairlane.runtime import Stopped, now_ms, run, until_stopped
from fairlane.settings import load_settings
from fairlane.tenants import load_tenants
from producer.auth import open_connection
from producer.client import FairlaneClient, RequestError, RequestSpec, SamplingParams
from producer.config import ProducerSettings


def _spec(s: ProducerSettings) -> RequestSpec:
    """The flags as the library's one request description (a fresh one per request:
    the deadline is relative to now)."""
    return RequestSpec(
        tenant=s.tenant, pool=s.pool, tier=s.tier or None, prompt=s.prompt,
        sampling=SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature,
                                seed=s.seed),
        priority=s.priority, ttft_budget_ms=s.ttft_budget_ms,
        deadline_ms=now_ms() + int(s.deadline_s * 1000) if s.deadline_s else None,
    )


async def stream_one(client: FairlaneClient, s: ProducerSettings,
                     limits: RateLimits | None) -> int:
    try:
        stream = await client.submit(_spec(s), rate_limits=limits)
        async for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            if chunk.finish_reason is not None:
                u = chunk.usage
                sys.stdout.write("\n")
                if u is not None:
                    print(f"[finish={chunk.finish_reason} prompt_tokens={u.prompt_tokens} "
                          f"completion_tokens={u.completion_tokens} ttft_ms={u.ttft_ms:.1f} "
                          f"queue_ms={u.queue_ms}]", file=sys.stderr)
    except RequestError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    return 0


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]


async def load(client: FairlaneClient, s: ProducerSettings, limits: RateLimits | None) -> int:
    ttft_ms: list[float] = []
    e2e_ms: list[float] = []
    errors: dict[str, int] = {}
    done = 0
    num_tokens = 0
    sem = asyncio.Semaphore(s.concurrency)
    t0 = time.perf_counter()

    async def one() -> None:
        nonlocal done, num_tokens
        async with sem:
            start = time.perf_counter()
            try:
                stream = await client.submit(_spec(s), rate_limits=limits)
                first = None
                async with asyncio.timeout(s.timeout_s):
                    async for chunk in stream:
                        if first is None:
                            first = time.perf_counter()
                        num_tokens += chunk.num_tokens
                ttft_ms.append((first - start) * 1000)
                e2e_ms.append((time.perf_counter() - start) * 1000)
            except RequestError as exc:
                errors[exc.code.value] = errors.get(exc.code.value, 0) + 1
            except TimeoutError:
                errors["timeout"] = errors.get("timeout", 0) + 1
            done += 1
            if sys.stderr.isatty() or done % max(1, s.count // 20) == 0 or done == s.count:
                width = 30
                filled = int(width * done / s.count)
                sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{s.count}")
                sys.stderr.flush()

    await asyncio.gather(*(one() for _ in range(s.count)))
    elapsed = time.perf_counter() - t0
    sys.stderr.write("\n")
    summary = {
        "requests": s.count, "ok": len(e2e_ms), "errors": errors,
        "elapsed_s": round(elapsed, 3), "req_per_s": round(len(e2e_ms) / elapsed, 2),
        "tokens_per_s": round(num_tokens / elapsed, 1),
        "ttft_ms_p50": round(_pct(ttft_ms, 50), 2), "ttft_ms_p99": round(_pct(ttft_ms, 99), 2),
        "e2e_ms_p50": round(_pct(e2e_ms, 50), 2), "e2e_ms_p99": round(_pct(e2e_ms, 99), 2),
    }
    if s.json_summary:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k:>14}: {v}")
    return 0 if not errors else 1


def _rate_limits(s: ProducerSettings) -> RateLimits | None:
    if not (s.redis_url and s.tenants_file):
        return None
    record = load_tenants(s.tenants_file).tenant(s.tenant)
    return RateLimits.of(record) if record else None


async def _connect(s: ProducerSettings) -> nats.NATS:
    """NATS, or ConnectionError naming the URL: a CLI gives up where a service waits.

    The CLI acts for one tenant (--tenant): logged in as that tenant's NATS user
    (--nats-user, see `fairlane nats-config`) it may only publish that tenant's
    requests and read that tenant's inboxes, which is all it does."""
    failures: list[Exception] = []
    holder: list[nats.NATS] = []

    async def on_error(exc: Exception) -> None:
        # nats-py's default prints a traceback per attempt; one line is enough.
        if holder and (holder[0].is_connected or holder[0].is_reconnecting):
            print(f"producer: NATS: {exc}", file=sys.stderr)
        else:
            failures.append(exc)

    try:
        nc = await open_connection(
            s.nats_url, prefix=s.prefix, tenant=s.tenant, user=s.nats_user,
            password=read_password(s), tls_ca_file=s.nats_tls_ca_file, connect_timeout=2,
            max_reconnect_attempts=2, reconnect_time_wait=0.5, error_cb=on_error)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        cause = failures[-1] if failures else exc
        who = f" as user {s.nats_user!r}" if s.nats_user else ""
        raise ConnectionError(f"cannot reach NATS at {s.nats_url}{who}: {cause}") from None
    holder.append(nc)
    return nc


async def amain(s: ProducerSettings, stop: asyncio.Event) -> int:
    if s.nats_user and not s.nats_user.startswith(SERVICE_USER_PREFIX) and s.nats_user != s.tenant:
        print(f"producer: error: NATS user {s.nats_user!r} is a tenant's and may submit only "
              f"as tenant {s.nats_user!r}, not {s.tenant!r}", file=sys.stderr)
        return 2
    limits = _rate_limits(s)
    try:
        nc = await until_stopped(_connect(s), stop)
    except Stopped:
        return 130
    except ConnectionError as exc:
        print(f"producer: error: {exc}", file=sys.stderr)
        return 1
    limiter = RateLimiter.from_url(s.redis_url) if limits else None
    client = FairlaneClient(nc, prefix=s.prefix, limiter=limiter, owns_connection=True,
                            tenant=s.tenant)
    try:
        # A tenant's NATS user may not touch the JetStream API: the fleet's services
        # create the streams. Without auth (or as a service user) make sure they exist,
        # so requests queue even before the fleet is up.
        provision = not s.nats_user or s.nats_user.startswith(SERVICE_USER_PREFIX)
        await until_stopped(client.start(provision_streams=provision), stop)
        work = asyncio.ensure_future(
            stream_one(client, s, limits) if s.count <= 1 else load(client, s, limits))
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            work.cancel()
            return 130
        stopper.cancel()
        return work.result()
    except Stopped:
        return 130
    finally:
        await client.close()
        if limiter is not None:
            await limiter.close()


def main(argv: list[str] | None = None) -> int:
    s = load_settings(ProducerSettings, argv, prog="producer",
                      description="submit requests to a fairlane fleet")
    configure_logging(s.log_level, json=False)
    return run(lambda stop: amain(s, stop))


if __name__ == "__main__":
    sys.exit(main())
