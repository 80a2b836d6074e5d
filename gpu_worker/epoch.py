"""Worker-side fencing of deposed dispatchers (DESIGN.md section 4).

Each `WorkBatch` carries its leader's lease epoch. The worker remembers the newest
epoch it has seen and refuses a non-empty batch from an older one: that is a deposed
leader's late answer, and starting it could exceed a tenant's quota or run a request
that the new leader also dispatches. Epoch 0 means "no election" (an older
dispatcher): accepted only while no elected leader has been seen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpochGuard:
    newest: int = 0

    def admit(self, epoch: int) -> bool:
        if epoch < self.newest:
            return False
        self.newest = epoch
        return True
