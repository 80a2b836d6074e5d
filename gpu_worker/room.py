"""How much work a worker asks for: the one rule, pure, shared by the worker's pull
loop (`gpu_worker.service`) and the fleet simulator (`fleetsim.fleet`)."""

from __future__ import annotations

from fairlane.protocol import EngineLoad


def pull_room(load: EngineLoad, num_accepted: int, max_num_seqs: int,
              prefetch_seqs: int) -> tuple[int, int, int]:
    """(items to ask for, of those how many would start at once, free KV tokens) for an
    engine with `load`, a batch cap of `max_num_seqs` and `num_accepted` requests
    accepted and not ended."""
    return pull_room_of(load.num_running, load.num_waiting,
                        load.kv_tokens_total - load.kv_tokens_used, num_accepted,
                        max_num_seqs, prefetch_seqs)


def pull_room_of(num_running: int, num_waiting: int, kv_tokens_free: int, num_accepted: int,
                 max_num_seqs: int, prefetch_seqs: int) -> tuple[int, int, int]:
    """`pull_room` from the load's figures. (The fleet simulator calls this, from its
    engines' counters: an `EngineLoad` per pull, a msgspec Struct whose fields compiled
    code reads generically, was ~2% of its time.)"""
    in_flight = max(num_accepted, num_running + num_waiting)
    free_slots = max(0, max_num_seqs - in_flight)
    room = max_num_seqs + prefetch_seqs - in_flight
    # Work already queued inside the engine (slot- or KV-bound) is placed early;
    # keep that queue to at most the prefetch, so decisions stay late.
    if num_waiting > 0:
        room = min(room, prefetch_seqs - num_waiting)
    return room, min(free_slots, max(room, 0)), max(0, kv_tokens_free)
