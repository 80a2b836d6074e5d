"""The admin endpoints: a live dashboard of every pool, and Prometheus ``/metrics``.

    GET /dashboard        a self-contained page (no external assets: `dashboard.html`)
                          whose script polls /dashboard/data every second
    GET /dashboard/data   JSON: the latest `PoolStats` snapshot of each pool
    GET /metrics          Prometheus text

All of them want an admin key of the tenants file (``admin.api_keys``), never a
tenant's key (401 otherwise): ``Authorization: Bearer <admin key>``, or, from a
browser, ``/dashboard?key=<admin key>`` once. That answer sets the key as an
HttpOnly, SameSite=Strict cookie for ``/dashboard`` and redirects to the bare URL
(the key leaves the address bar and history). The cookie holds the key itself and is
checked against the tenants file on every request, so every streamer replica accepts
it and removing the key from the file signs every browser out.

`StatsFeed` subscribes to ``<prefix>.stats.*`` (the dispatchers publish one snapshot
per pool every ``--stats-interval-s``, see `dispatcher.stats`) and keeps the latest
of each pool; the figures are defined there.
"""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from fairlane.protocol import PoolStats, ProtocolError, decode_pool_stats
from fairlane.runtime import now_ms
from fairlane.subjects import Subjects
from streamer import metrics as edge_metrics
from streamer.errors import EdgeError
from streamer.http_api import error_response, json_response

log = structlog.get_logger(__name__)

COOKIE = "fairlane_admin"
COOKIE_PATH = "/dashboard"
COOKIE_MAX_AGE_S = 8 * 3600
STALE_AFTER_S = 5.0  # a snapshot older than this is shown as stale (its dispatcher quiet)
FORGET_AFTER_S = 600.0  # a pool silent this long leaves the dashboard
_NO_STORE = {"Cache-Control": "no-store"}


class StatsFeed:
    """The latest `PoolStats` of each pool, as the dispatchers publish them."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[PoolStats, float]] = {}  # pool -> (stats, monotonic s)
        self._sub: Any = None

    async def start(self, nc: Any, subjects: Subjects) -> None:
        self._sub = await nc.subscribe(subjects.stats_all(), cb=self._on_stats)

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # the connection may be closing: nothing to undo
                log.debug("stats_unsubscribe_failed", error=repr(exc))
            self._sub = None

    async def _on_stats(self, msg: Any) -> None:
        try:
            stats = decode_pool_stats(msg.data)
        except ProtocolError as exc:
            log.warning("bad_pool_stats", subject=msg.subject, error=exc.message)
            return
        self.latest[stats.pool] = (stats, time.monotonic())

    def view(self) -> dict[str, Any]:
        """What /dashboard/data answers: every pool's latest snapshot and its age."""
        now = time.monotonic()
        for pool in [p for p, (_, at) in self.latest.items() if now - at > FORGET_AFTER_S]:
            del self.latest[pool]
        pools = [{"age_s": round(now - at, 1), "stale": now - at > STALE_AFTER_S,
                  "stats": _with_defaults(stats)}
                 for _, (stats, at) in sorted(self.latest.items())]
        return {"ts_ms": now_ms(), "pools": pools}


def _with_defaults(obj: Any) -> Any:
    """A Struct as plain data with every field (the wire omits default values)."""
    if isinstance(obj, msgspec.Struct):
        return {f: _with_defaults(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        return [_with_defaults(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _with_defaults(v) for k, v in obj.items()}
    return obj


# --- auth ------------------------------------------------------------------------------


def _bearer(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def _is_admin(request: Request, key: str | None) -> bool:
    return bool(key) and request.app.state.edge.config.is_admin_key(key)


def admin_key(request: Request) -> str | None:
    """The admin key the request carries (header, else the dashboard's cookie), if it
    is one of the tenants file's; None otherwise (a tenant's key is none)."""
    cookie = request.cookies.get(COOKIE)
    for key in (_bearer(request), unquote(cookie) if cookie else None):
        if _is_admin(request, key):
            return key
    return None


def _refusal(request: Request) -> EdgeError:
    cfg = request.app.state.edge.config
    if not cfg.num_admin_keys:
        return EdgeError.unauthorized(
            "no admin key is configured: add admin.api_keys to the tenants file")
    return EdgeError.unauthorized(
        "this endpoint needs an admin key (admin.api_keys of the tenants file; a tenant's "
        "key is not one): send 'Authorization: Bearer <admin key>'")


# --- routes ----------------------------------------------------------------------------


@cache
def _page() -> str:
    return Path(__file__).with_name("dashboard.html").read_text(encoding="utf-8")


_LOGIN = """<!doctype html><html><head><meta charset="utf-8"><title>fairlane: sign in</title>
<style>body{{font:15px system-ui,sans-serif;margin:3em;color:#222}}
input{{font:inherit;padding:.3em}}</style></head><body>
<h1>fairlane dashboard</h1><p>{message}</p>
<form method="get" action="/dashboard"><label>Admin key
<input type="password" name="key" autocomplete="off" autofocus></label>
<button>Open</button></form></body></html>"""


async def dashboard(request: Request) -> Response:
    key = request.query_params.get("key")
    if key is not None:
        if not _is_admin(request, key):
            return HTMLResponse(_LOGIN.format(message="That is not an admin key."), 401,
                                {"WWW-Authenticate": "Bearer", **_NO_STORE})
        # The key leaves the URL (history, logs, Referer); the cookie carries it on.
        out = RedirectResponse("/dashboard", 303, headers=_NO_STORE)
        out.set_cookie(COOKIE, quote(key, safe=""), max_age=COOKIE_MAX_AGE_S,
                       path=COOKIE_PATH, httponly=True, samesite="strict",
                       secure=request.url.scheme == "https")
        return out
    if admin_key(request) is None:
        return HTMLResponse(_LOGIN.format(message=_refusal(request).message), 401,
                            {"WWW-Authenticate": "Bearer", **_NO_STORE})
    return HTMLResponse(_page(), headers={
        **_NO_STORE, "X-Frame-Options": "DENY",
        "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
                                   "style-src 'unsafe-inline'; frame-ancestors 'none'"})


async def dashboard_data(request: Request) -> Response:
    if admin_key(request) is None:
        return error_response(_refusal(request))
    return json_response(request.app.state.stats_feed.view(), headers=_NO_STORE)


async def metrics(request: Request) -> Response:
    if admin_key(request) is None:
        return error_response(_refusal(request))
    edge_metrics.expire()  # idle tenants' series go before they are shown
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
