"""Settings of one GPU worker (`python -m gpu_worker --help` lists them all).

Every field is a flag (``--max-num-seqs``) and an env var (``FAIRLANE_MAX_NUM_SEQS``).
"""

from __future__ import annotations

import os
import socket

import msgspec


def default_worker_id() -> str:
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host or 'worker'}-{os.getpid()}"


class WorkerSettings(msgspec.Struct, kw_only=True):
    nats_url: str = "nats://127.0.0.1:4222"
    prefix: str = "fl"
    pool: str = "default"
    worker_id: str = ""  # empty: <hostname>-<pid>
    engine: str = "sim"  # "sim" (simulator) | "vllm"
    max_num_seqs: int = 32  # the engine's batch cap (vLLM max_num_seqs)
    prefetch_seqs: int = 4  # accepted beyond the batch cap, to keep the batch full
    heartbeat_ms: int = 1000
    coalesce_ms: int = 5  # never hold a token longer than this before publishing
    pull_wait_ms: int = 1000  # long-poll budget offered to the dispatcher
    drain_timeout_s: float = 30.0
    max_model_len: int = 4096  # 0: unset (vLLM: the model's own; simulator: KV size)
    log_level: str = "info"
    log_json: bool = True

    # Simulator (engine="sim").
    cost_model: str = "default"  # name in gpu_worker/sim/costmodels or a .json path
    time_scale: float = 1.0  # simulator sleeps × this (1.0 = real time)
    sim_kv_tokens_total: int = 0  # 0: the cost model's KV size
    sim_fail_after_steps: int = 0  # test hook: crash the simulated engine after N steps

    # vLLM (engine="vllm"), used by gpu_worker.vllm_engine.
    model: str = ""
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    tenant_cache_salt: bool = True  # per-tenant prefix-cache isolation
    kv_cache_space_gib: float | None = None  # CPU build: VLLM_CPU_KVCACHE_SPACE

    def __post_init__(self) -> None:
        if not self.worker_id:
            self.worker_id = default_worker_id()
        if self.engine not in ("sim", "vllm"):
            raise ValueError(f"engine must be 'sim' or 'vllm', got {self.engine!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefetch_seqs < 0:
            raise ValueError("prefetch_seqs must be >= 0")
        if self.heartbeat_ms < 10:
            raise ValueError("heartbeat_ms must be >= 10")
        if self.coalesce_ms < 0 or self.pull_wait_ms < 0:
            raise ValueError("coalesce_ms and pull_wait_ms must be >= 0")
