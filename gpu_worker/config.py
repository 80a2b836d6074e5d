"""Settings of one GPU worker (`python -m gpu_worker --help` lists them all).

Every field is a flag (``--max-num-seqs``) and an env var (``FAIRLANE_MAX_NUM_SEQS``).
"""

from __future__ import annotations

import os
import socket
from typing import Annotated, Literal

import msgspec

from fairlane.gctune import YOUNG_OBJECTS
from fairlane.logs import LogLevel
from fairlane.settings import PositiveFloat, PositiveInt
from fairlane.streams import StreamSettings


def default_worker_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host or 'worker'}-{os.getpid()}"


class WorkerSettings(StreamSettings, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"  # NATS server URL
    prefix: str = "fl"  # subject and stream prefix of the deployment
    pool: str = "default"  # the model pool this worker serves
    worker_id: str = ""  # empty: <hostname>-<pid>
    engine: Literal["sim", "vllm"] = "sim"  # the simulator or vLLM
    max_num_seqs: PositiveInt = 32  # the engine's batch cap (vLLM max_num_seqs)
    prefetch_seqs: Annotated[int, msgspec.Meta(ge=0)] = 4  # accepted beyond the batch cap, to keep the batch full
    heartbeat_ms: Annotated[int, msgspec.Meta(ge=10)] = 1000  # liveness report period
    # The dispatcher's worker timeout, until its first heartbeat ack says otherwise:
    # this worker publishes for its work only within 0.8 x that of its last ack.
    lease_timeout_ms: Annotated[int, msgspec.Meta(ge=100)] = 3500  # the dispatcher's worker timeout until an ack says it
    # Without any ack for this long past the lease, the dispatcher has surely handed
    # the work elsewhere: abort it silently and rejoin as a new incarnation.
    abandon_after_ms: Annotated[int, msgspec.Meta(ge=0)] = 10_000  # unacked this long past the lease: abort work, rejoin
    # At most one chunk per request per coalesce_ms: a token goes out at once unless
    # its request sent one less than this ago (then it waits out the rest, with any
    # that follow); never held longer. 0: every token at once.
    coalesce_ms: int = 5
    pull_wait_ms: int = 1000  # long-poll budget offered to the dispatcher
    drain_timeout_s: float = 30.0  # on stop: how long running requests may finish
    max_model_len: int = 4096  # 0: unset (vLLM: the model's own; simulator: KV size)
    # Net new objects between young garbage collections, and what start-up left alive
    # frozen (fairlane.gctune; 0 keeps Python's own 700 and nothing frozen): a full
    # collection walking the imports stopped every stream on the worker for tens of ms.
    gc_young_objects: Annotated[int, msgspec.Meta(ge=0)] = YOUNG_OBJECTS
    log_level: LogLevel = "info"  # least severe log level written
    log_json: bool = True  # JSON log lines (else human-readable)
    metrics_port: int = 0  # port of the Prometheus /metrics endpoint; 0 = none
    metrics_host: str = "127.0.0.1"  # /metrics address: 0.0.0.0 in a container
    # Bounds the tenant label's values on /metrics (see gpu_worker.metrics): beyond this
    # many, tenants are counted as tenant="_other"; an idle tenant's series are removed.
    metrics_max_tenants: Annotated[int, msgspec.Meta(ge=0)] = 1000  # most tenants with a /metrics label of their own
    metrics_tenant_idle_s: PositiveFloat = 600.0  # a tenant idle this long loses its /metrics series

    # Simulator (engine="sim").
    step_model: str = "default"  # step-time model: name in gpu_worker/sim/step_models or a .json path
    time_scale: float = 1.0  # simulator sleeps × this (1.0 = real time)
    sim_kv_tokens_total: int = 0  # 0: the step model's KV size
    sim_fail_after_steps: int = 0  # test hook: crash the simulated engine after N steps

    # vLLM (engine="vllm"), used by gpu_worker.vllm_engine.
    model: str = ""
    dtype: str = "auto"  # vLLM weights dtype (auto, float16, bfloat16, float32)
    gpu_memory_utilization: float = 0.9  # vLLM: fraction of GPU memory it may use
    tensor_parallel_size: PositiveInt = 1  # vLLM: GPUs one model is split over
    enforce_eager: bool = False  # vLLM: no CUDA graphs (starts faster, runs slower)
    load_format: str = "auto"  # vLLM weight loading; "dummy" = random weights (tests)
    skip_tokenizer_init: bool = False  # vLLM: no tokenizer (token ids in and out)
    tenant_cache_salt: bool = True  # per-tenant prefix-cache isolation
    kv_cache_space_gib: float | None = None  # CPU build: VLLM_CPU_KVCACHE_SPACE

    def __post_init__(self) -> None:
        if not self.worker_id:
            self.worker_id = default_worker_id()
