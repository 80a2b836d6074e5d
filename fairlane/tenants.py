"""The tenants file: tiers, pools, tenants and their (hashed) API keys.

One YAML (``.yaml``/``.yml``) or TOML (``.toml``) file, chosen by extension::

    tiers:                      # ordered, highest first
      - {name: enterprise, floor_share: 0.5, aging_ms: 0, engine_priority: 0}
      - {name: free, aging_ms: 30000, engine_priority: 10}
    pools:
      default: {policy: drr, cost_model: tokens, quantum: 4096}
    tenants:
      acme:
        tier: enterprise
        weight: 2
        api_keys: ["sha256:<64 hex>"]   # hash_api_key("sk-..."); never plain text

Every section is decoded with strict ``msgspec`` Structs (unknown fields are
refused), then checked for ranges and cross references. Any problem raises
`TenantsFileError` naming the file and the field path, e.g.
``tenants.yaml: tenants.acme.weight: must be > 0, got 0``.

Without a file the fleet runs on `default_tenants()`: one tier ``standard``, one pool
``default`` (drr, unknown tenants allowed), no tenants and no keys.

`TenantsWatcher` polls the file (mtime/size/inode) and swaps in a new config only
if it is valid; a bad edit is logged and the previous good config is kept.

``python -m fairlane.tenants hash-key`` reads a key from stdin and prints its hash.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import msgspec.inspect
import structlog
import yaml

from dispatcher.scheduler.config import SchedulerConfig, TenantConfig, TierConfig
from fairlane.protocol import ID_PATTERN
from fairlane.validation import RequestLimits

log = structlog.get_logger(__name__)

__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_TIER",
    "PoolSpec",
    "TenantRecord",
    "TenantsFile",
    "TenantsFileError",
    "TenantsWatcher",
    "TierSpec",
    "default_tenants",
    "hash_api_key",
    "load_tenants",
    "parse_tenants",
    "tenants_from_dict",
]

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


# --- the loaded file ---


class TenantsFile:
    """A validated tenants file. Treat as immutable; reloads build a new one."""

    def __init__(
        self,
        *,
        tiers: tuple[TierSpec, ...],
        pools: dict[str, PoolSpec],
        tenants: dict[str, TenantRecord],
        key_hashes: dict[str, str],
        path: str | None = None,
    ) -> None:
        self.tiers = tiers
        self.pools = pools
        self.tenants = tenants
        # "sha256:<lowercase hex>" -> (that same stored hash, tenant name)
        self._key_hashes = {h: (h, name) for h, name in key_hashes.items()}
        self.path = path  # None = the built-in default (no file, no keys)

    def __repr__(self) -> str:
        return (
            f"TenantsFile(path={self.path!r}, tiers={[t.name for t in self.tiers]}, "
            f"pools={sorted(self.pools)}, num_tenants={len(self.tenants)}, "
            f"num_api_keys={len(self._key_hashes)})"
        )

    @property
    def is_default(self) -> bool:
        """True for the built-in config used when no tenants file is given."""
        return self.path is None

    @property
    def num_api_keys(self) -> int:
        return len(self._key_hashes)

    def tier(self, name: str) -> TierSpec | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None

    def tenant(self, name: str) -> TenantRecord | None:
        return self.tenants.get(name)

    def pool(self, name: str) -> PoolSpec:
        try:
            return self.pools[name]
        except KeyError:
            if self.is_default and self.pools:
                # No tenants file: every pool gets the built-in defaults.
                return next(iter(self.pools.values()))
            raise KeyError(
                f"pool {name!r} is not defined in {self.path or 'the default tenants config'}"
            ) from None

    def default_tier(self, pool: str) -> str:
        return self.pool(pool).default_tier or self.tiers[-1].name

    def lookup_key(self, presented_key: str) -> TenantRecord | None:
        """The tenant owning `presented_key` (a plain-text key), or None."""
        if not presented_key:
            return None
        digest = hash_api_key(presented_key)
        entry = self._key_hashes.get(digest)
        if entry is None:
            return None
        stored, name = entry
        if not hmac.compare_digest(stored.encode("ascii"), digest.encode("ascii")):
            return None
        return self.tenants.get(name)

    def request_limits(self, pool: str, base: RequestLimits | None = None) -> RequestLimits:
        """`RequestLimits` for `pool`: the pool's overrides on top of `base`."""
        spec = self.pool(pool)
        base = base or RequestLimits()
        return RequestLimits(
            max_tokens=spec.max_tokens if spec.max_tokens is not None else base.max_tokens,
            max_prompt_chars=base.max_prompt_chars,
            max_prompt_tokens=(
                spec.max_prompt_tokens
                if spec.max_prompt_tokens is not None
                else base.max_prompt_tokens
            ),
            max_stop_sequences=base.max_stop_sequences,
        )

    def scheduler_config(self, pool: str) -> SchedulerConfig:
        """A fresh `SchedulerConfig` for `pool` (tenants not allowed in it are left out)."""
        spec = self.pool(pool)
        tiers = [
            TierConfig(
                name=t.name,
                floor_share=t.floor_share,
                aging_ms=t.aging_ms,
                engine_priority=t.engine_priority,
            )
            for t in self.tiers
        ]
        tenants = {
            r.name: TenantConfig(
                name=r.name,
                tier=r.tier,
                weight=r.weight,
                max_concurrent=r.max_concurrent,
                max_kv_tokens=r.max_kv_tokens,
                max_queued=r.max_queued,
            )
            for r in self.tenants.values()
            if r.allows_pool(pool)
        }
        return SchedulerConfig(
            policy=spec.policy,
            cost_model=spec.cost_model,
            quantum=spec.quantum,
            tiers=tiers,
            tenants=tenants,
            allow_unknown_tenants=spec.allow_unknown_tenants,
            default_tenant=TenantConfig(name="_default", tier=self.default_tier(pool)),
            max_queued_total=spec.max_queued_total,
        )


def default_tenants() -> TenantsFile:
    """The config used when no tenants file is given: open access, one tier, one pool."""
    return TenantsFile(
        tiers=(TierSpec(name=DEFAULT_TIER),),
        pools={DEFAULT_POOL: PoolSpec(policy="drr", allow_unknown_tenants=True)},
        tenants={},
        key_hashes={},
        path=None,
    )


# --- loading and validation ---


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (a silently shadowed tenant is a bug)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            dup = key in seen
        except TypeError:  # unhashable key; let the base constructor report it
            break
        if dup:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,  # type: ignore[arg-type]
)


def load_tenants(path: str | os.PathLike[str]) -> TenantsFile:
    """Read and validate a tenants file; raise `TenantsFileError` on any problem."""
    p = Path(path)
    source = str(p)
    fmt = _format_of(p, source)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TenantsFileError(source, "", f"cannot read: {e}") from e
    return parse_tenants(text, fmt=fmt, source=source)


def parse_tenants(
    text: str, *, fmt: Literal["yaml", "toml"] = "yaml", source: str = "<tenants>"
) -> TenantsFile:
    if fmt == "toml":
        try:
            data: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise TenantsFileError(source, "", f"invalid TOML: {e}") from e
    elif fmt == "yaml":
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            raise TenantsFileError(source, "", f"invalid YAML: {e}") from e
    else:
        raise TenantsFileError(source, "", f"unknown format {fmt!r} (expected yaml or toml)")
    return tenants_from_dict(data, source=source)


def _format_of(p: Path, source: str) -> Literal["yaml", "toml"]:
    ext = p.suffix.lower()
    if ext in (".yaml", ".yml"):
        return "yaml"
    if ext == ".toml":
        return "toml"
    raise TenantsFileError(
        source, "", f"unknown extension {ext or '(none)'!r}: use .yaml, .yml or .toml"
    )


def tenants_from_dict(data: Any, *, source: str = "<tenants>") -> TenantsFile:
    """Validate already-parsed data (a YAML/TOML document) into a `TenantsFile`."""
    v = _Validator(source)
    return v.run(data)


class _Validator:
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

    def run(self, data: Any) -> TenantsFile:
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
        return TenantsFile(
            tiers=tiers, pools=pools, tenants=tenants, key_hashes=key_hashes, path=self.source
        )

    def tiers(self, raw: Any) -> tuple[TierSpec, ...]:
        if raw is None:
            return (TierSpec(name=DEFAULT_TIER),)
        if not isinstance(raw, list):
            raise self.fail("tiers", f"expected a list (highest tier first), got {_kind(raw)}")
        if not raw:
            raise self.fail("tiers", "must list at least one tier (or be left out)")
        out: list[TierSpec] = []
        seen: set[str] = set()
        for i, item in enumerate(raw):
            path = f"tiers[{i}]"
            t: TierSpec = self.convert(item, TierSpec, path)
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
            if p.default_tier is not None and p.default_tier not in tier_names:
                raise self.fail(
                    f"{path}.default_tier",
                    f"unknown tier {p.default_tier!r} (tiers: {', '.join(sorted(tier_names))})",
                )
            out[name] = p
        return out

    def tenants(
        self, raw: Any, tiers: tuple[TierSpec, ...], pools: dict[str, PoolSpec]
    ) -> tuple[dict[str, TenantRecord], dict[str, str]]:
        raw = self.mapping(raw, "tenants")
        tier_names = {t.name for t in tiers}
        lowest = tiers[-1].name
        records: dict[str, TenantRecord] = {}
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
                digest = KEY_PREFIX + key[len(KEY_PREFIX) :].lower()
                owner = key_hashes.get(digest)
                if owner is not None:
                    where = "twice for this tenant" if owner == name else f"also used by {owner!r}"
                    raise self.fail(kpath, f"duplicate API key hash ({where})")
                key_hashes[digest] = name
            records[name] = TenantRecord(
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


class TenantsWatcher:
    """Holds the current tenants config and reloads it when the file changes.

    `path=None` serves `default_tenants()` forever. The first load raises
    `TenantsFileError` (fail fast at startup); later bad edits are logged and the
    previous good config is kept until the file changes again.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None
        self.last_error: TenantsFileError | None = None
        if self.path is None:
            self._current = default_tenants()
            self._signature: tuple[int, ...] | None = None
            return
        self._signature = self._stat()
        self._current = load_tenants(self.path)

    @property
    def current(self) -> TenantsFile:
        return self._current

    def _stat(self) -> tuple[int, ...] | None:
        assert self.path is not None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def maybe_reload(self) -> bool:
        """Re-read the file if it changed. True when a new config was installed.

        On an invalid edit: keep the old config, set `last_error`, log once per
        change, return False.
        """
        if self.path is None:
            return False
        sig = self._stat()
        if sig == self._signature:
            return False
        self._signature = sig
        try:
            if sig is None:
                raise TenantsFileError(str(self.path), "", "file is missing")
            new = load_tenants(self.path)
        except TenantsFileError as e:
            self.last_error = e
            log.warning("tenants_reload_failed", path=str(self.path), error=str(e))
            return False
        self._current = new
        self.last_error = None
        log.info(
            "tenants_reloaded",
            path=str(self.path),
            num_tenants=len(new.tenants),
            num_pools=len(new.pools),
        )
        return True


# --- CLI: hash a key without putting it in shell history ---


def _main(argv: list[str]) -> int:
    if argv[:1] != ["hash-key"] or len(argv) > 2:
        print(
            "usage: python -m fairlane.tenants hash-key [KEY]   (reads KEY from stdin if omitted)",
            file=sys.stderr,
        )
        return 2
    key = argv[1] if len(argv) == 2 else sys.stdin.read().strip()
    if not key:
        print("error: empty key", file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
