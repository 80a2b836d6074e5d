"""The fidelity report's prose (`bench/render_fidelity.py`, `bench/fidelity.py`): what
each section of bench/results/fidelity*.md measures and how to read it."""

from __future__ import annotations

SPLIT_TEXT = """\
Where each TTFT goes, for the requests that finished without being preempted (a
diagnostic, not judged; bench/fidelity_obs.py): the dispatcher's queue, the worker
(from receiving the dispatch to the first token: the step in progress, the prefill
step) and the messages (the TTFT less both: the client's publish and JetStream, the
dispatch's and the first token's way, the worker's wait for the started record's
ack). The real fleet's parts come from each request's `Usage` (`queue_ms` in whole
ms, `ttft_ms`), the simulator's from its clock, where the messages are what it adds
by construction: `network_ms`, and the request's client legs where the run drew them. A p99 needs ≥ 200 requests per run ("n/a" otherwise); parts' p99s
do not add up to the TTFT's."""


HOW_TO_READ = """\
Each scenario's arrivals (a fleetsim workload, seed = the repetition) go once through
the simulator (`fleetsim`, in-process, virtual time) and once through the real fleet
(loopback nats-server, dispatcher and `gpu_worker --engine sim --time-scale 1.0`
processes, the producer library as the client, one client process per traffic
class; `real-shared`, when run: one client for all; `real-gc-default`, when run: the
workers under Python's default collector; `sim-constant`, when run: the simulator as
calibrated before). **sim** and **real** columns are medians over repetitions; the error is (sim − real) ÷ real per repetition, as median
(min to max), and a metric is within the target when the median's magnitude is ≤ 10%.
TTFT p99 needs ≥ 200 requests in every run compared, else the row compares maxima.
Only requests arriving inside the window are timed; throughput counts the output
tokens generated inside it. TPOT is a diagnostic: real/sim > 1 means the real workers
step slower than their step model (event-loop time per step, CPU contention).

The simulator's delays are measured on the idle rig, never fitted to these scenarios:
`network_ms`, one dispatcher↔worker message (a core-NATS round trip ÷ 2), and the
clients' legs (the client's publish, JetStream, the dispatcher's fetch, the started
record's ack, the token's way back, and the real worker's own time per admission):
each idle probe's real TTFT less the simulator's, one drawn per request, so the idle
spread is kept, not only its median. What it does not model: how those grow with
load (a busy nats-server, processes waiting for one of two cores); the worker's own
event-loop time (token publishing, coalescing) that lengthens each real step beyond
the model; the producer's stream watchdog traffic.

The fleet's size is the largest this 2-core machine held with headroom (see
bench/fidelity.py's docstring). The Runs table gives each real run's CPU per process
and the machine's busy fraction, which counts every job on the machine, not only
this benchmark's: a real run on a busy machine steps slower than its model."""


SHARED_TEXT = """\
`real-shared`: the same real fleet and arrivals with every traffic class's requests
sent and read by one client in the benchmark's process (one connection, one event
loop), as this benchmark ran before per-class client processes. Not judged: it
measures the rig's client as well as the fleet (a quiet tenant's submits wait behind
a flood's burst of submits there, and its first tokens share the client with the
flood's token chunks)."""


CONSTANT_TEXT = """\
`sim-constant`: the same arrivals through the simulator as this benchmark calibrated it
before 2026-11-30: no clients' legs, and one `network_ms` on every dispatcher↔worker
message (pulls included), the idle probes' real TTFT p50 less the simulator's without
hops. Against the same real runs; not judged (the verdict is `sim`'s, above)."""


GC_TEXT = """\
`real-gc-default`: the same real fleet and arrivals with its workers under Python's own
garbage-collector settings (`--gc-young-objects 0`), as every real run before
2026-11-30 had them: a full collection there walks everything the worker's imports
left (~46,000 objects) and stops its event loop, and every stream on it, for tens of
ms at a time. Against the same simulator runs; not judged (the verdict is `real`'s,
above: workers with the default, `fairlane/gctune.py`)."""
