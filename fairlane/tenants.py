"""The tenants file: tiers, pools, tenants and their (hashed) API keys.

One YAML (``.yaml``/``.yml``) or TOML (``.toml``) file, chosen by extension::

    tiers:                      # ordered, highest first
      - {name: enterprise, floor_share: 0.5, aging_ms: 0, engine_priority: 0}
      - {name: free, aging_ms: 30000, engine_priority: 10}
    pools:
      default:
        policy: drr
        cost_model: tokens
        quantum: 4096
        preemption: {preempt_after_ms: 2000, min_run_ms: 1000, max_per_s: 20}  # optional
    tenants:
      acme:
        tier: enterprise
        weight: 2
        api_keys: ["sha256:<64 hex>"]   # hash_api_key("sk-..."); never plain text
    admin:                      # optional: operators' keys (streamer /dashboard, /metrics)
      api_keys: ["sha256:<64 hex>"]

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

import hmac
import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

import structlog
import yaml

from fairlane.poolconfig import (
    DEFAULT_POOL,
    DEFAULT_TIER,
    PoolSpec,
    SchedulerConfig,
    TenantConfig,
    TierConfig,
    check_policy,
    quantum_warning,
)
from fairlane.tenants_schema import TenantRecord, TenantsFileError, hash_api_key
from fairlane.tenants_validate import Validator
from fairlane.validation import RequestLimits

log = structlog.get_logger(__name__)

__all__ = [
    "DEFAULT_POOL",
    "DEFAULT_TIER",
    "PoolSpec",
    "TenantConfig",
    "TenantRecord",
    "TenantsFile",
    "TenantsFileError",
    "TenantsWatcher",
    "TierConfig",
    "default_tenants",
    "hash_api_key",
    "load_tenants",
    "parse_tenants",
    "resolve_pool_config",
    "tenants_from_dict",
]

# --- the loaded file ---


class TenantsFile:
    """A validated tenants file. Treat as immutable; reloads build a new one."""

    def __init__(
        self,
        *,
        tiers: tuple[TierConfig, ...],
        pools: dict[str, PoolSpec],
        tenants: dict[str, TenantConfig],
        key_hashes: dict[str, str],
        path: str | None = None,
        admin_key_hashes: frozenset[str] = frozenset(),
    ) -> None:
        self.tiers = tiers
        self.pools = pools
        self.tenants = tenants
        # "sha256:<lowercase hex>" -> (that same stored hash, tenant name)
        self._key_hashes = {h: (h, name) for h, name in key_hashes.items()}
        self.path = path  # None = the built-in default (no file, no keys)
        # The admin section's keys ("sha256:<lowercase hex>"): the streamer's admin
        # endpoints (dashboard, /metrics). No tenant key is one of them.
        self._admin_hashes = admin_key_hashes

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

    def tier(self, name: str) -> TierConfig | None:
        for t in self.tiers:
            if t.name == name:
                return t
        return None

    def tenant(self, name: str) -> TenantConfig | None:
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

    def lookup_key(self, presented_key: str) -> TenantConfig | None:
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

    @property
    def num_admin_keys(self) -> int:
        return len(self._admin_hashes)

    def is_admin_key(self, presented_key: str) -> bool:
        """Whether `presented_key` (plain text) is one of the admin section's keys."""
        if not presented_key:
            return False
        digest = hash_api_key(presented_key).encode("ascii")
        # Compared with each stored hash in constant time, whichever matches.
        return any([hmac.compare_digest(h.encode("ascii"), digest) for h in self._admin_hashes])

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


def default_tenants() -> TenantsFile:
    """The config used when no tenants file is given: open access, one tier, one pool."""
    return TenantsFile(
        tiers=(TierConfig(name=DEFAULT_TIER),),
        pools={DEFAULT_POOL: PoolSpec(policy="drr", allow_unknown_tenants=True)},
        tenants={},
        key_hashes={},
        path=None,
    )


def resolve_pool_config(
    tenants: TenantsFile | None, pool: str, *, policy_override: str | None = None
) -> SchedulerConfig:
    """The pool's scheduler config: tenants file (None = `default_tenants()`) + overrides.

    The only place a `SchedulerConfig` is derived from configuration, called at start and
    on every reload, so a command-line override (``--policy``) holds for the process's
    whole life instead of turning every later file edit into a "policy changed" refusal.
    Always a fresh object (the scheduler caches per-config state). KeyError: the pool is
    not in the file; ValueError: the override names no policy.
    """
    tf = tenants if tenants is not None else default_tenants()
    spec = tf.pool(pool)
    if (warning := quantum_warning(pool, spec)) is not None:
        log.warning("pool_quantum_below_one_request", pool=pool, warning=warning)
    return SchedulerConfig(
        policy=check_policy(policy_override) if policy_override else spec.policy,
        cost_model=spec.cost_model,
        quantum=spec.quantum,
        tiers=list(tf.tiers),
        tenants={r.name: r for r in tf.tenants.values() if r.allows_pool(pool)},
        allow_unknown_tenants=spec.allow_unknown_tenants,
        default_tenant=TenantConfig(name="_default", tier=tf.default_tier(pool)),
        max_queued_total=spec.max_queued_total,
        preemption=spec.preemption,
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
    tiers, pools, tenants, key_hashes, admin_hashes = Validator(source).run(data)
    return TenantsFile(
        tiers=tiers, pools=pools, tenants=tenants, key_hashes=key_hashes, path=source,
        admin_key_hashes=admin_hashes,
    )


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
