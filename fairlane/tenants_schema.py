"""The tenants file's schema: strict msgspec decoding, ids, limits and key hashes.

Ranges and cross-references are checked afterwards by `fairlane.tenants_validate`;
`fairlane.tenants` is the public API.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

from fairlane.poolconfig import DEFAULT_POOL, DEFAULT_TIER, PoolSpec, TenantConfig, TierConfig
from fairlane.protocol import ID_PATTERN

__all__ = ["DEFAULT_POOL", "DEFAULT_TIER", "PoolSpec", "TenantConfig", "TenantRecord",
           "TenantsFileError", "TierConfig", "hash_api_key"]

KEY_PREFIX = "sha256:"

_ID_RE = re.compile(ID_PATTERN)
_HASHED_KEY_RE = re.compile(r"^sha256:[0-9a-fA-F]{64}$")
_MSGSPEC_PATH_RE = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>.*)`$", re.DOTALL)
_TOP_LEVEL = ("tiers", "pools", "tenants", "admin")
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
# Tiers and pools decode straight into the kernel's config types; a tenant's entry has
# a shape of its own (optional tier, API keys) and becomes a `TenantConfig` once checked.


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


class _AdminSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Operators: their API keys open the streamer's admin endpoints (the dashboard,
    /metrics). An admin key is no tenant's key: it submits no requests, and no tenant
    key opens the admin endpoints."""

    api_keys: list[str] = []  # hashed like tenants' keys: "sha256:<64 hex>"


# The edge's historical name for a tenant's config: the same type, not a copy.
TenantRecord = TenantConfig


# --- keys ---


def hash_api_key(key: str) -> str:
    """``sha256:<hex>`` of the key's UTF-8 bytes: what the tenants file stores."""
    return KEY_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()
