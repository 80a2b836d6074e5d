"""The cycle collector's settings for fairlane's allocation-heavy loops.

CPython collects its youngest generation after every 700 net new container objects
(tuples, dicts, msgspec Structs, coroutine frames). A dispatcher allocates a few dozen
per message and keeps many of them for a request's life (queued and held requests,
in-flight state); each young collection walks what survived since the last one, and
every tenth walks more. With the default, collections took 10-13% of a busy
dispatcher's time (BENCHMARKS §1, `bench/bench_ingest.py`'s `-gc-default` rows). A
finished request leaves none of fairlane's objects to the cycle collector
(`tests/integration/test_pipeline.py`); what it finds comes with time, not requests
(~100 objects a second over producer, dispatcher and worker: nats-py's timeouts and
their tracebacks). So collecting rarely frees the same memory, later: what cycles there
are wait for at most `young_objects` more allocations.

`tuned_gc` also freezes what is alive when it starts (modules, settings, the tenants
file's objects, a simulator's workload), so no collection walks those again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# Every service's default (`--gc-young-objects`). The dispatcher: GC pauses of a busy
# dispatcher 10-13% -> 3-4% of its time in bench_ingest on the 2-core dev machine. The
# worker and the streamer: under Python's own settings a full collection walks what
# their imports left (~46,000 and ~67,000 objects: 9 and 30 ms on an idle core), and in
# bench/fidelity.py's steady scenario stopped each busy worker's event loop, and every
# stream on it, for 25-47 ms; frozen, it walks only what came after start-up.
YOUNG_OBJECTS = 50_000

_tuning = False  # inside tuned_gc with a threshold: refreeze() freezes again


@contextlib.contextmanager
def tuned_gc(young_objects: int) -> Iterator[None]:
    """Within: what is alive now is frozen, and a young collection waits for
    `young_objects` net allocations (older generations every 20 of the one below).
    0 leaves the interpreter's settings alone. Restored afterwards."""
    if young_objects <= 0:
        yield
        return
    global _tuning
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_objects, 20, 20)
    _tuning = True
    try:
        yield
    finally:
        _tuning = False
        gc.set_threshold(*threshold)
        gc.unfreeze()


def refreeze() -> None:
    """Within `tuned_gc` (else nothing): collect, then freeze what is alive now, for
    what start-up makes after the imports (a worker's engine: vLLM's modules and
    model state), so no later collection walks it again."""
    if _tuning:
        gc.collect()
        gc.freeze()
