"""Plain records of a chaos run (requests, attempts, fleet shape) and its constants."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fairlane.errors import ErrorCode
from fairlane.natscluster import Isolated

PREFIX = "fl"
POOL = "default"
BILLABLE_FINISH = ("stop", "length")
LOST_CODES = (ErrorCode.WORKER_LOST.value, ErrorCode.STREAM_LOST.value)


def now() -> float:
    return time.monotonic()


@dataclass
class FleetSpec:
    num_workers: int = 2
    max_num_seqs: int = 8
    # Simulator: default step model (~8.8 ms/step at 8 seqs) x 4 = ~35 ms per token,
    # so 30..90 output tokens take ~1-3 s.
    time_scale: float = 4.0
    ack_wait_s: float = 10.0
    lease_ttl_s: float = 3.0
    num_dispatchers: int = 1
    tenants_yaml: str | None = None
    # NATS nodes: 1 = one nats-server; 3 = a cluster on loopback, streams and the
    # leader-lease bucket with 3 replicas (fairlane.natscluster).
    nats_cluster: int = 1
    # One node of the cluster in a network namespace of its own (the partition
    # scenarios, `tests.chaos.scenarios_partition`); the harness's taps stay off it.
    isolated: Isolated | None = None


# --- what the client saw ----------------------------------------------------------------


@dataclass
class Attempt:
    submit_t: float
    end_t: float | None = None
    outcome: str | None = None  # "ok" or an error code; None: no answer (yet)
    tokens: int = 0  # tokens the client read before its answer
    first_t: float | None = None
    finish_reason: str | None = None
    usage_tokens: int | None = None
    # The library's attempt numbers this submission covered: it resumes a stream whose
    # worker was lost as the next attempt by itself (producer.client max_resumes).
    lib_first: int = 0
    lib_last: int = 0


@dataclass
class Req:
    rid: str
    tenant: str
    max_tokens: int
    group: str
    tier: str = "standard"
    created_t: float = field(default_factory=now)
    attempts: list[Attempt] = field(default_factory=list)
    submit_errors: list[str] = field(default_factory=list)  # publishes retried
    refused: str | None = None  # submit refused for good (code)
    done: bool = False  # the client has its final answer
    retry_lost: int = 0  # re-submit after worker_lost/stream_lost this many times

    @property
    def num_lib_attempts(self) -> int:
        return max((a.lib_last for a in self.attempts), default=0) + 1

    @property
    def end_t(self) -> float | None:
        if self.refused is not None:
            return self.created_t
        return self.attempts[-1].end_t if self.attempts else None

    @property
    def outcome(self) -> str | None:
        if self.refused is not None:
            return self.refused
        return self.attempts[-1].outcome if self.attempts else None


# --- what the fleet did -----------------------------------------------------------------
