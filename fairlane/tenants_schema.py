"""The tenants file's schema: strict msgspec decoding, ids, limits and key hashes.

Ranges and cross-references are checked afterwards by `fairlane.tenants_validate`;
`fairlane.tenants` is the public API.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Literal

import msgspec

from fairlane.protocol import ID_PATTERN

DEFAULT_TIER = "standard"
DEFAULT_POOL = "default"
KEY_PREFIX = "sha256:"

_ID_RE = re.compile(ID_PATTERN)
_HASHED_KEY_RE = re.compile(r"^sha256:[0-9a-fA-F]{64}$")
_MSGSPEC_PATH_RE = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>.*)`$", re.DOTALL)
_TOP_LEVEL = ("tiers", "pools", "tenants")
_FLOOR_EPSILON = 1e-9


class TenantsFileError(ValueError):
    """The tenants file cannot be used. The message names the file and field path."""

    def __init__(self, source: str, path: str, message: str) -> None:
        self.source = source
        self.path = path
        self.detail = message
        where = f"{path}: " if path else ""
        super().__init__(f"{source}: {where}{message}")


# --- schema (strict decoding; ranges and references are checked afterwards) ---


class TierSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    name: str
    floor_share: float = 0.0  # reserved fraction of dispatched cost, in [0, 1]
    aging_ms: float = 0.0  # 0 = no aging
    engine_priority: int = 0  # vLLM priority: lower runs first, evicted last


class PoolSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    policy: Literal["fifo", "drr", "vtc"] = "drr"
    cost_model: Literal["requests", "tokens", "kv_seconds"] = "requests"
    quantum: float = 1.0  # DRR budget per turn at weight 1, in cost units
    max_tokens: int | None = None  # request limit (output tokens); None = built-in default
    max_prompt_tokens: int | None = None  # request limit; None = built-in default
    max_queued_total: int = 1_000_000
    allow_unknown_tenants: bool = False  # in a file, unlisted tenants are refused by default
    default_tier: str | None = None  # tier of unlisted tenants; None = lowest tier


class _TenantSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    tier: str | None = None  # None = lowest tier
    weight: float = 1.0
    max_concurrent: int | None = None
    max_kv_tokens: int | None = None
    max_queued: int | None = None
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    pools: list[str] | None = None  # None = every pool
    api_keys: list[str] = []


@dataclass(frozen=True, slots=True)
class TenantRecord:
    """A tenant as the edge and the dispatcher see it (keys are not kept here)."""

    name: str
    tier: str
    weight: float = 1.0
    max_concurrent: int | None = None  # sequences in flight
    max_kv_tokens: int | None = None  # KV tokens in flight
    max_queued: int | None = None  # requests waiting in the dispatcher
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    pools: tuple[str, ...] | None = None  # None = every pool

    def allows_pool(self, pool: str) -> bool:
        return self.pools is None or pool in self.pools


# --- keys ---


def hash_api_key(key: str) -> str:
    """``sha256:<hex>`` of the key's UTF-8 bytes: what the tenants file stores."""
    return KEY_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()
