"""Dispatcher settings: flags and FAIRLANE_* env vars (see fairlane.settings)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from fairlane.gctune import YOUNG_OBJECTS
from fairlane.logs import LogLevel
from fairlane.poolconfig import Policy
from fairlane.settings import PositiveFloat, PositiveInt
from fairlane.streams import StreamSettings


class DispatcherSettings(StreamSettings, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"  # NATS server URL
    prefix: str = "fl"  # subject and stream prefix of the deployment
    pool: str = "default"  # the model pool this dispatcher schedules
    # Tenants, tiers and pool policy (YAML or TOML); empty = built-in defaults (one
    # tier, drr, anyone may submit).
    tenants_file: str = ""
    # Overrides the pool's policy from the tenants file, at start and on every reload.
    policy: Policy | None = None
    # JetStream: a held message is redelivered to another dispatcher after ack_wait_s
    # of silence, so this is the failover delay after a dispatcher crash.
    ack_wait_s: PositiveFloat = 30.0
    # One dispatcher per pool leads, by a lease in the NATS KV bucket <prefix>_leader
    # (renewed every ttl/3); the others wait. A dead leader's lease lapses after this
    # long and a standby takes over; a graceful stop releases it at once.
    leader_lease_ttl_s: PositiveFloat = 3.0
    # Must cover every message the dispatcher holds (queued + dispatched-not-started);
    # JetStream's default of 1,000 silently starves fetches once reached.
    max_held_messages: PositiveInt = 200_000
    fetch_batch: PositiveInt = 256  # messages per JetStream fetch
    # A worker silent for this long is dead: unstarted work is requeued, started work
    # gets a retryable worker_lost error.
    worker_timeout_ms: PositiveInt = 3_500
    housekeeping_ms: PositiveInt = 200  # period of expiry, shedding and liveness checks
    # A tenant with nothing queued or in flight this long is forgotten: its scheduler
    # state (a debt is kept until repaid) and its /metrics series.
    tenant_idle_s: PositiveFloat = 600.0
    # Requests on a tier this pool lacks get an error and leave the stream at the next
    # sweep; those for a pool nobody was seen leading, after stranded_after_s.
    stranded_after_s: PositiveFloat = 10.0  # how long a pool must go unled before its requests are refused
    janitor_every_s: PositiveFloat = 2.0  # period of the sweep for requests nobody serves
    # Where a request may aim its tokens: "tenant" = only its tenant's inboxes
    # (<prefix>.inbox.<owner>.<tenant>.>), else it is refused; "any" = any subject (no
    # auth: the broker cannot tell tenants apart anyway); "auto" = "tenant" when the
    # NATS server authenticates clients.
    reply_scope: Literal["auto", "tenant", "any"] = "auto"
    stop_timeout_s: float = 10.0  # bound on a graceful stop (NATS may be gone)
    max_tokens: PositiveInt = 4096  # largest max_tokens a request may ask for
    max_prompt_chars: PositiveInt = 200_000  # longest prompt accepted, in characters
    # How often the leader publishes the pool's stats snapshot on <prefix>.stats.<pool>
    # (the streamer's admin dashboard reads it); 0 = never.
    stats_interval_s: float = 1.0
    metrics_port: int = 0  # port of the Prometheus /metrics endpoint; 0 = none
    metrics_host: str = "127.0.0.1"  # /metrics address: 0.0.0.0 in a container
    # Most tenants with /metrics series of their own at once (dispatcher.metrics); the
    # rest are counted as tenant="_other".
    metrics_max_tenants: Annotated[int, msgspec.Meta(ge=0)] = 1000
    # Net new objects between young garbage collections (fairlane.gctune; Python's own
    # default is 700, kept by 0). Collecting that often took 10-13% of a busy
    # dispatcher's time; its messages make almost no cycles.
    gc_young_objects: Annotated[int, msgspec.Meta(ge=0)] = YOUNG_OBJECTS
    log_level: LogLevel = "info"  # least severe log level written
    log_json: bool = True  # JSON log lines (else human-readable)

