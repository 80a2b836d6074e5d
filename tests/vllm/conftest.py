"""One real vLLM-CPU engine per test session, on a tiny random-weight model.

Starting vLLM costs ~30 s on two cores, so every test in tests/vllm shares this
engine: tests use unique request ids and must leave it idle (nothing in flight)
when they end.
"""

from __future__ import annotations

import os
import uuid

import pytest

from fairlane.protocol import ChatMessage, WorkItem
from tests.helpers import request as request_with_sampling
from tests.vllm.tiny_model import write_tiny_model

MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
async def vllm_engine(tiny_model_dir):
    # Missing vLLM fails the tier rather than skipping it: a green vllm tier must mean
    # the engine ran (scripts/test.sh leaves the tier out only with FAIRLANE_SKIP_VLLM=1).
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"the vllm tier needs vLLM ({exc}); FAIRLANE_SKIP_VLLM=1 skips the tier",
                    pytrace=False)
    # The CPU build sizes its KV cache from this (GiB); 1 is plenty for the tests.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Unpinned OpenMP threads: on a 2-vCPU machine vLLM-CPU's default pinning stalled
    # every process for seconds at a time (README "Running with vLLM"), and these tests
    # run NATS, a dispatcher and a worker beside the engine.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from gpu_worker.vllm_engine import VllmEngine, VllmEngineConfig

    engine = VllmEngine(
        VllmEngineConfig(
            model=str(tiny_model_dir),
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=MAX_MODEL_LEN,
            dtype="float32",
            enforce_eager=True,
            load_format="dummy",
        )
    )
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def make_item():
    """WorkItem factory with a unique request id per call."""

    def make(
        *,
        tenant: str = "tenant-a",
        engine_priority: int = 0,
        cache_salt: str | None = None,
        messages: list[tuple[str, str]] | None = None,
        **request_fields,
    ) -> WorkItem:
        if messages is not None:
            request_fields["messages"] = [ChatMessage(role=r, content=c) for r, c in messages]
        request = request_with_sampling(
            request_id=f"r-{uuid.uuid4().hex[:12]}",
            tenant=tenant,
            pool="cpu",
            tier="std",
            reply_to="_INBOX.test",
            **request_fields,
        )
        return WorkItem(request=request, engine_priority=engine_priority, cache_salt=cache_salt)

    return make
