"""Validation of a parsed tenants document: every range and reference, with errors
that name the file and the field path (``tenants.acme.weight: must be > 0``)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import msgspec.inspect

from fairlane.tenants_schema import (
    _FLOOR_EPSILON,
    _HASHED_KEY_RE,
    _ID_RE,
    _MSGSPEC_PATH_RE,
    _TOP_LEVEL,
    DEFAULT_POOL,
    DEFAULT_TIER,
    KEY_PREFIX,
    PoolSpec,
    TenantConfig,
    TenantsFileError,
    TierConfig,
    _AdminSpec,
    _TenantSpec,
)


class Validator:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, message: str) -> TenantsFileError:
        return TenantsFileError(self.source, path, message)

    # helpers

    def convert(self, obj: Any, typ: type, path: str) -> Any:
        if not isinstance(obj, dict):
            raise self.fail(path, f"expected a mapping, got {_kind(obj)}")
        try:
            return msgspec.convert(obj, typ, strict=True)
        except msgspec.ValidationError as e:
            msg = str(e)
            sub = ""
            m = _MSGSPEC_PATH_RE.match(msg)
            if m:
                msg, sub = m["msg"], m["path"]
            if msg.startswith("Invalid enum value") and sub.count(".") == 1:
                choices = _literal_choices(typ, sub[1:])
                if choices:
                    msg += f" (expected one of: {', '.join(choices)})"
            raise self.fail(path + sub, msg[:1].lower() + msg[1:]) from None

    def check_id(self, value: Any, path: str, what: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"{what} must be a string, got {_kind(value)}")
        if not _ID_RE.match(value):
            raise self.fail(
                path, f"{what} {value!r} is invalid: 1-64 characters of A-Z a-z 0-9 _ -"
            )
        return value

    def mapping(self, obj: Any, path: str) -> dict[Any, Any]:
        if obj is None:
            return {}
        if not isinstance(obj, dict):
            raise self.fail(path, f"expected a mapping, got {_kind(obj)}")
        return obj

    def finite(self, value: float, path: str) -> None:
        if not math.isfinite(value):
            raise self.fail(path, f"must be a finite number, got {value}")

    def positive(self, value: float | None, path: str) -> None:
        if value is not None:
            self.finite(value, path)
            if value <= 0:
                raise self.fail(path, f"must be > 0, got {value}")

    # sections

    def run(self, data: Any) -> tuple[tuple[TierConfig, ...], dict[str, PoolSpec],
                                     dict[str, TenantConfig], dict[str, str], frozenset[str]]:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise self.fail("", f"expected a mapping at the top level, got {_kind(data)}")
        for key in data:
            if key not in _TOP_LEVEL:
                raise self.fail(
                    str(key), f"unknown section (expected one of: {', '.join(_TOP_LEVEL)})"
                )
        tiers = self.tiers(data.get("tiers"))
        tier_names = {t.name for t in tiers}
        pools = self.pools(data.get("pools"), tier_names)
        tenants, key_hashes = self.tenants(data.get("tenants"), tiers, pools)
        admin_hashes = self.admin(data.get("admin"), key_hashes)
        return tiers, pools, tenants, key_hashes, admin_hashes

    def admin(self, raw: Any, tenant_keys: dict[str, str]) -> frozenset[str]:
        """The admin section's key hashes: none may also be a tenant's key."""
        a: _AdminSpec = self.convert(raw if raw is not None else {}, _AdminSpec, "admin")
        out: set[str] = set()
        for i, key in enumerate(a.api_keys):
            kpath = f"admin.api_keys[{i}]"
            digest = self.hashed_key(key, kpath)
            if digest in out:
                raise self.fail(kpath, "duplicate API key hash (twice for admin)")
            if digest in tenant_keys:
                raise self.fail(kpath, "duplicate API key hash (also tenant "
                                f"{tenant_keys[digest]!r}'s: an admin key is no tenant's key)")
            out.add(digest)
        return frozenset(out)

    def hashed_key(self, key: str, kpath: str) -> str:
        """A stored key hash, normalised ("sha256:<lowercase hex>"); never a plain key."""
        # Never echo the value: it may be a live secret pasted by mistake.
        if not _HASHED_KEY_RE.match(key):
            if key.startswith(KEY_PREFIX):
                raise self.fail(
                    kpath, "malformed hashed key: expected 'sha256:' and 64 hex digits"
                )
            raise self.fail(
                kpath,
                "looks like a plain-text API key; store only its hash "
                "('sha256:<64 hex>'), e.g. from "
                "`printf %s KEY | python -m fairlane.tenants hash-key`",
            )
        return KEY_PREFIX + key[len(KEY_PREFIX) :].lower()

    def tiers(self, raw: Any) -> tuple[TierConfig, ...]:
        if raw is None:
            return (TierConfig(name=DEFAULT_TIER),)
        if not isinstance(raw, list):
            raise self.fail("tiers", f"expected a list (highest tier first), got {_kind(raw)}")
        if not raw:
            raise self.fail("tiers", "must list at least one tier (or be left out)")
        out: list[TierConfig] = []
        seen: set[str] = set()
        for i, item in enumerate(raw):
            path = f"tiers[{i}]"
            t: TierConfig = self.convert(item, TierConfig, path)
            self.check_id(t.name, f"{path}.name", "tier name")
            if t.name in seen:
                raise self.fail(f"{path}.name", f"duplicate tier {t.name!r}")
            seen.add(t.name)
            self.finite(t.floor_share, f"{path}.floor_share")
            if not 0.0 <= t.floor_share <= 1.0:
                raise self.fail(f"{path}.floor_share", f"must be in [0, 1], got {t.floor_share}")
            self.finite(t.aging_ms, f"{path}.aging_ms")
            if t.aging_ms < 0:
                raise self.fail(f"{path}.aging_ms", f"must be >= 0, got {t.aging_ms}")
            out.append(t)
        total = sum(t.floor_share for t in out)
        if total > 1.0 + _FLOOR_EPSILON:
            raise self.fail("tiers", f"floor_share values must sum to <= 1, got {total:g}")
        return tuple(out)

    def pools(self, raw: Any, tier_names: set[str]) -> dict[str, PoolSpec]:
        if raw is None:
            return {DEFAULT_POOL: PoolSpec()}
        raw = self.mapping(raw, "pools")
        if not raw:
            raise self.fail("pools", "must define at least one pool (or be left out)")
        out: dict[str, PoolSpec] = {}
        for name, item in raw.items():
            self.check_id(name, f"pools.{name}", "pool name")
            path = f"pools.{name}"
            p: PoolSpec = self.convert(item if item is not None else {}, PoolSpec, path)
            self.positive(p.quantum, f"{path}.quantum")
            self.positive(p.max_tokens, f"{path}.max_tokens")
            self.positive(p.max_prompt_tokens, f"{path}.max_prompt_tokens")
            self.positive(p.max_queued_total, f"{path}.max_queued_total")
            self.preemption(p, f"{path}.preemption")
            if p.default_tier is not None and p.default_tier not in tier_names:
                raise self.fail(
                    f"{path}.default_tier",
                    f"unknown tier {p.default_tier!r} (tiers: {', '.join(sorted(tier_names))})",
                )
            out[name] = p
        return out

    def preemption(self, p: PoolSpec, path: str) -> None:
        pre = p.preemption
        for field in ("preempt_after_ms", "min_run_ms"):
            value = getattr(pre, field)
            self.finite(value, f"{path}.{field}")
            if value < 0:
                raise self.fail(f"{path}.{field}", f"must be >= 0, got {value}")
        self.positive(pre.max_per_s, f"{path}.max_per_s")
        self.positive(pre.max_per_request, f"{path}.max_per_request")

    def tenants(
        self, raw: Any, tiers: tuple[TierConfig, ...], pools: dict[str, PoolSpec]
    ) -> tuple[dict[str, TenantConfig], dict[str, str]]:
        raw = self.mapping(raw, "tenants")
        tier_names = {t.name for t in tiers}
        lowest = tiers[-1].name
        records: dict[str, TenantConfig] = {}
        key_hashes: dict[str, str] = {}
        for name, item in raw.items():
            self.check_id(name, f"tenants.{name}", "tenant id")
            path = f"tenants.{name}"
            t: _TenantSpec = self.convert(item if item is not None else {}, _TenantSpec, path)
            tier = t.tier if t.tier is not None else lowest
            if tier not in tier_names:
                raise self.fail(
                    f"{path}.tier",
                    f"unknown tier {tier!r} (tiers: {', '.join(t.name for t in tiers)})",
                )
            self.positive(t.weight, f"{path}.weight")
            for field in (
                "max_concurrent",
                "max_kv_tokens",
                "max_queued",
                "requests_per_min",
                "tokens_per_min",
            ):
                self.positive(getattr(t, field), f"{path}.{field}")
            allowed: tuple[str, ...] | None = None
            if t.pools is not None:
                for i, pool in enumerate(t.pools):
                    if pool not in pools:
                        raise self.fail(
                            f"{path}.pools[{i}]",
                            f"unknown pool {pool!r} (pools: {', '.join(sorted(pools))})",
                        )
                allowed = tuple(dict.fromkeys(t.pools))
            for i, key in enumerate(t.api_keys):
                kpath = f"{path}.api_keys[{i}]"
                digest = self.hashed_key(key, kpath)
                owner = key_hashes.get(digest)
                if owner is not None:
                    where = "twice for this tenant" if owner == name else f"also used by {owner!r}"
                    raise self.fail(kpath, f"duplicate API key hash ({where})")
                key_hashes[digest] = name
            records[name] = TenantConfig(
                name=name,
                tier=tier,
                weight=float(t.weight),
                max_concurrent=t.max_concurrent,
                max_kv_tokens=t.max_kv_tokens,
                max_queued=t.max_queued,
                requests_per_min=t.requests_per_min,
                tokens_per_min=t.tokens_per_min,
                pools=allowed,
            )
        return records, key_hashes


def _literal_choices(typ: type, field: str) -> list[str]:
    info = msgspec.inspect.type_info(typ)
    for f in getattr(info, "fields", ()):
        if f.name == field and isinstance(f.type, msgspec.inspect.LiteralType):
            return [str(v) for v in f.type.values]
    return []


def _kind(obj: Any) -> str:
    if obj is None:
        return "null"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(obj), type(obj).__name__
    )


# --- hot reload ---
