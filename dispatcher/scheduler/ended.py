"""What the pool remembers of ended requests: the JetStream dedupe window's answers.

A request that ended (finished, failed, dropped, cancelled) is remembered for
`ttl_ms`, the dedupe window, and at most `max_entries` of them (oldest forgotten
first), so that a repeat of the same attempt is answered with its status instead of
running again (`PoolCore.submit`, `PoolCore.status`).

Every finished request passes here, so it is a dict and a deque: the dict answers
lookups, the deque holds the entries in the order they ended, for the trim. (An
OrderedDict did both, with a linked-list node per entry and an iterator per trim
check.) A request that ends again replaces its entry; the old one stays in the deque,
no longer the dict's, until the trim reaches it and drops it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from dispatcher.scheduler.actions import SendError


@dataclass(slots=True, init=False)
class Ended:
    # One per ended request: `__init__` written, `Final` fields (as types.Dispatch).
    attempt: Final[int]
    error: Final[SendError | None]
    ended_ms: Final[float]

    def __init__(self, attempt: int, error: SendError | None, ended_ms: float) -> None:
        self.attempt, self.error, self.ended_ms = attempt, error, ended_ms


class EndedMemory:
    """Ended requests by id, for `ttl_ms`, at most `max_entries`."""

    def __init__(self, ttl_ms: float, max_entries: int) -> None:
        self.ttl_ms, self.max_entries = ttl_ms, max_entries
        self._by_id: dict[str, Ended] = {}
        self._order: deque[tuple[str, Ended]] = deque()  # oldest end first

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str, now_ms: float) -> Ended | None:
        """The request's end if it is still within the window (the trim may lag)."""
        e = self._by_id.get(request_id)
        return e if e is not None and now_ms - e.ended_ms <= self.ttl_ms else None

    def add(self, request_id: str, attempt: int, error: SendError | None,
            now_ms: float) -> None:
        e = self._by_id[request_id] = Ended(attempt, error, now_ms)
        self._order.append((request_id, e))

    def trim(self, now_ms: float) -> None:
        """Forget the ends past the window, and the oldest beyond `max_entries`."""
        by_id, order = self._by_id, self._order
        while order and (len(by_id) > self.max_entries
                         or now_ms - order[0][1].ended_ms > self.ttl_ms):
            request_id, e = order.popleft()
            if by_id.get(request_id) is e:  # else a later end replaced it
                del by_id[request_id]
