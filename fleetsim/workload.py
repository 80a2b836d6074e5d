"""What arrives when: the simulator's workload, from a workload file or FL_USAGE records.

A workload file (YAML) names the pool's settings and tiers exactly as a tenants file
does, and traffic classes, each `count` tenants with the same per-tenant arrival
process and request lengths::

    duration_s: 3600
    seed: 1
    pool: {policy: drr, cost_model: tokens, quantum: 544}   # a tenants file's pools.<name>
    tiers: [{name: enterprise, floor_share: 0.5}, {name: free}] # highest first
    classes:
      - name: small              # tenants small-0 .. small-99999 ("small" if count == 1)
        count: 100000
        tier: free               # default: the lowest tier
        weight: 1                # optional limits: max_concurrent, max_queued, max_kv_tokens
        arrival: {process: on_off, rate_per_s: 0.5, on_s: 30, off_s: 300}  # per tenant
        prompt_tokens: {dist: fixed, value: 32}
        output_tokens: {dist: lognormal, mean: 256, sigma: 0.6, max: 2048}
        max_tokens: 512          # default: the output's upper bound, capped by the pool's

Processes (`processes`): poisson, burst, on_off, diurnal; lengths: fixed, uniform,
lognormal, normal, choice, empirical. `Workload.arrivals()` merges one stream per class
with a heap, so it holds O(classes) state however many tenants or requests there are;
the tenant table and `scheduler_config` are O(tenants), as PoolCore needs them.

Tiers, the pool section and each class's tenant fields go through the tenants file's
own validator (`fairlane.tenants.tenants_from_dict`, one representative tenant per
class) and `resolve_pool_config`, so PoolCore runs what a dispatcher given the same
tenants file would; only the per-tenant copies are built here, for speed.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import re
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from fairlane.poolconfig import SchedulerConfig, TenantConfig
from fairlane.protocol import ID_PATTERN, Usage
from fairlane.tenants import (
    TenantsFile,
    TenantsFileError,
    _UniqueKeyLoader,
    resolve_pool_config,
    tenants_from_dict,
)
from fleetsim.processes import (
    Dist,
    Fields,
    Process,
    WorkloadError,
    class_arrivals,
    kind_of,
    merge_arrivals,
    parse_dist,
    parse_process,
)
from fleetsim.records import Arrival, TenantTable

__all__ = ["TrafficClass", "Workload", "WorkloadError", "from_usage", "load_workload",
           "workload_from_dict"]

POOL_NAME = "sim"  # the simulated pool's name (only the tenants file validator sees it)
_TOP_LEVEL = ("duration_s", "seed", "pool", "tiers", "classes")
_TENANT_FIELDS = ("tier", "weight", "max_concurrent", "max_queued", "max_kv_tokens")
_CLASS_FIELDS = ("name", "count", *_TENANT_FIELDS, "arrival", "prompt_tokens",
                 "output_tokens", "max_tokens")
_ID_RE = re.compile(ID_PATTERN)
_MAX_ID_CHARS = 64


@dataclass(slots=True)
class TrafficClass:
    """`num_tenants` tenants with indices first_tenant .. first_tenant + num_tenants - 1."""

    name: str
    first_tenant: int
    num_tenants: int
    process: Process
    prompt_tokens: Dist
    output_tokens: Dist
    max_tokens: int

    def tenant_name(self, k: int) -> str:
        return self.name if self.num_tenants == 1 else f"{self.name}-{k}"

    def arrivals(self, seed: int, duration_s: float) -> Iterator[Arrival]:
        # Generators keyed by the class's name rather than its position: editing one
        # class's lengths, or adding a class, leaves the other streams' arrival times
        # as they were (comparable runs).
        return class_arrivals(self.process, self.prompt_tokens, self.output_tokens,
                              self.first_tenant, self.num_tenants, self.max_tokens,
                              _rng(seed, self.name, "times"), _rng(seed, self.name, "lengths"),
                              duration_s)


def _rng(seed: int, class_name: str, purpose: str) -> random.Random:
    # blake2b, not hash(): str hashes are salted per process; runs must repeat.
    digest = hashlib.blake2b(f"{seed}\0{class_name}\0{purpose}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class _Replay:
    """Recorded arrivals in time order, in flat arrays (~36 bytes a request)."""

    def __init__(self, t_s: array, tenant: array, prompt: array, output: array,
                 max_tokens: array) -> None:
        self.cols = (t_s, tenant, prompt, output, max_tokens)

    def count_before(self, duration_s: float) -> int:
        return bisect_left(self.cols[0], duration_s)

    def arrivals(self, duration_s: float) -> Iterator[Arrival]:
        for t_s, tenant, prompt, output, max_tokens in zip(*self.cols, strict=True):
            if t_s >= duration_s:  # the caller may have shortened duration_s
                return
            yield Arrival(t_s, tenant, prompt, output, max_tokens)


class Workload:
    """A simulator workload: tenants, the pool's scheduler config, and arrivals."""

    def __init__(self, *, duration_s: float, seed: int, tenants: TenantTable,
                 scheduler_config: SchedulerConfig, classes: Iterable[TrafficClass] = (),
                 replay: _Replay | None = None, source: str = "<workload>") -> None:
        self.duration_s = duration_s
        self.seed = seed
        self.tenants = tenants
        self.scheduler_config = scheduler_config
        self.classes = list(classes)  # empty for a replay of FL_USAGE records
        self.source = source
        self._replay = replay

    def __repr__(self) -> str:
        return (f"Workload(source={self.source!r}, duration_s={self.duration_s}, "
                f"num_tenants={len(self.tenants)}, classes={[c.name for c in self.classes]})")

    def arrivals(self) -> Iterator[Arrival]:
        """Every arrival with 0 <= t_s < duration_s, in time order (ties: class order),
        the same for the same seed. A fresh iterator each call; `seed` and `duration_s`
        are read at the call, so a caller may override them after loading."""
        if self._replay is not None:
            return self._replay.arrivals(self.duration_s)
        return merge_arrivals([c.arrivals(self.seed, self.duration_s) for c in self.classes])

    def expected_requests(self) -> float:
        """The mean number of arrivals over `duration_s` (exact for a replay)."""
        if self._replay is not None:
            return float(self._replay.count_before(self.duration_s))
        return sum(c.process.expected(c.num_tenants, self.duration_s) for c in self.classes)


# --- the workload file ---


def load_workload(path: str | os.PathLike[str] | dict[str, Any]) -> Workload:
    """Read a workload YAML file (or take an already-parsed dict) and validate it."""
    if isinstance(path, dict):
        return workload_from_dict(path)
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(source, "", f"cannot read: {e}") from e
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise WorkloadError(source, "", f"invalid YAML: {e}") from e
    return workload_from_dict(data, source=source)


def workload_from_dict(data: Any, source: str = "<workload>") -> Workload:
    """Validate a parsed workload document; `WorkloadError` names the field path."""
    top = Fields(data, source, "", _TOP_LEVEL)
    duration_s = float(top.num("duration_s", gt=0))
    seed = top.num("seed", 0, integer=True)
    raw_classes = top.get("classes")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise top.fail("classes", f"expected a non-empty list, got {kind_of(raw_classes)}")

    specs: list[tuple[Fields, str, int]] = []
    protos: dict[str, dict[str, Any]] = {}
    paths: dict[str, str] = {}
    for i, raw in enumerate(raw_classes):
        path = f"classes[{i}]"
        f = Fields(raw, source, path, _CLASS_FIELDS)
        name = f.get("name")
        if not isinstance(name, str) or not _ID_RE.match(name):
            raise f.fail("name", f"class name {name!r} is invalid: 1-64 characters of "
                                 "A-Z a-z 0-9 _ -")
        if name in protos:
            raise f.fail("name", f"duplicate class {name!r} (also {paths[name]})")
        count = f.num("count", 1, ge=1, integer=True)
        if count > 1 and len(name) + 1 + len(str(count - 1)) > _MAX_ID_CHARS:
            raise f.fail("name", f"too long for {count} tenants: {name}-{count - 1} would be "
                                 f"over {_MAX_ID_CHARS} characters")
        # The class's tenant fields as a tenants file entry: the product's validator
        # checks them once for the whole class.
        protos[name] = {k: f.raw[k] for k in _TENANT_FIELDS if k in f.raw}
        paths[name] = path
        specs.append((f, name, count))

    tf, cfg = _scheduler_config(source, top.get("tiers", None), top.get("pool", None),
                                protos, paths)
    limits = tf.request_limits(POOL_NAME)
    classes: list[TrafficClass] = []
    first = 0
    for f, name, count in specs:
        prompt = parse_dist(f.get("prompt_tokens"), source, f.at("prompt_tokens"))
        output = parse_dist(f.get("output_tokens"), source, f.at("output_tokens"))
        if prompt.upper is not None and prompt.upper > limits.max_prompt_tokens:
            raise f.fail("prompt_tokens", f"draws up to {prompt.upper} tokens, over the pool's "
                                          f"max_prompt_tokens ({limits.max_prompt_tokens})")
        default_max = min(output.upper or limits.max_tokens, limits.max_tokens)
        max_tokens = f.num("max_tokens", default_max, ge=1, integer=True)
        if max_tokens > limits.max_tokens:
            raise f.fail("max_tokens", f"must be <= the pool's max_tokens "
                                       f"({limits.max_tokens}), got {max_tokens}")
        process = parse_process(f.get("arrival"), source, f.at("arrival"))
        classes.append(TrafficClass(name, first, count, process, prompt, output, max_tokens))
        first += count

    table = _add_tenants(cfg, tf, classes, paths, source)
    return Workload(duration_s=duration_s, seed=seed, tenants=table, scheduler_config=cfg,
                    classes=classes, source=source)


def _scheduler_config(source: str, tiers: Any, pool: Any, protos: dict[str, dict[str, Any]],
                      paths: dict[str, str]) -> tuple[TenantsFile, SchedulerConfig]:
    """Tiers, pool and one tenant per class through the tenants file's validator, then
    the dispatcher's own `resolve_pool_config`; errors renamed to the workload's paths."""
    doc: dict[str, Any] = {"pools": {POOL_NAME: pool if pool is not None else {}},
                           "tenants": protos}
    if tiers is not None:
        doc["tiers"] = tiers
    try:
        tf = tenants_from_dict(doc, source=source)
    except TenantsFileError as e:
        raise WorkloadError(source, _workload_path(e.path, paths), e.detail) from None
    return tf, resolve_pool_config(tf, POOL_NAME)


def _workload_path(path: str, class_paths: dict[str, str]) -> str:
    """tenants file path -> workload path: pools.sim.x -> pool.x, tenants.c.x -> classes[i].x."""
    head, _, rest = path.partition(".")
    if head == "pools":
        _, _, rest = rest.partition(".")
        return f"pool.{rest}" if rest else "pool"
    if head == "tenants":
        name, _, rest = rest.partition(".")
        where = class_paths.get(name, f"tenants.{name}")
        return f"{where}.{rest}" if rest else where
    return path


def _add_tenants(cfg: SchedulerConfig, tf: TenantsFile, classes: list[TrafficClass],
                 paths: dict[str, str], source: str) -> TenantTable:
    """Every class's tenants into `cfg.tenants` and a `TenantTable` (the class's
    representative entry is replaced by its `count` copies)."""
    table = TenantTable(tiers=[t.name for t in cfg.tiers])
    tier_index = {name: i for i, name in enumerate(table.tiers)}
    tenants: dict[str, TenantConfig] = {}
    for c in classes:
        p = tf.tenants[c.name]
        names = [c.tenant_name(k) for k in range(c.num_tenants)]
        for name in names:
            if name in tenants:
                raise WorkloadError(source, f"{paths[c.name]}.name",
                                    f"tenant {name!r} is also a tenant of an earlier class")
            tenants[name] = TenantConfig(
                name=name, tier=p.tier, weight=p.weight, max_concurrent=p.max_concurrent,
                max_kv_tokens=p.max_kv_tokens, max_queued=p.max_queued)
        table.names.extend(names)
        table.tier_of.extend([tier_index[p.tier]] * c.num_tenants)
        table.weight_of.extend([p.weight] * c.num_tenants)
    cfg.tenants = tenants
    return table


# --- replay of FL_USAGE records ---


def from_usage(path: str | os.PathLike[str], tiers: list[Any] | None = None,
               pool: dict[str, Any] | None = None) -> Workload:
    """A workload replaying FL_USAGE: a JSON-lines file of `fairlane.protocol.Usage`.

    Each record arrives at ts_ms - e2e_ms - queue_ms (its finish, less its run and its
    wait in the dispatcher), in seconds from the earliest; duration_s spans up to the
    last finish. output_tokens = completion_tokens; max_tokens the same (a cut or
    aborted request ends there again), except after a natural "stop", whose cap was
    evidently larger: 2x + 16. A tenant keeps the tier of its first record. `tiers`:
    names (or tier entries as in a workload file) ordering the tiers found, highest
    first; default alphabetical. `pool`: the pool section. Weights are 1. A record
    seen twice (same request_id and attempt) counts once. Memory: O(records).
    """
    source = str(path)
    decoder = msgspec.json.Decoder(Usage)
    start_ms, tenant_col = array("d"), array("q")
    prompt_col, output_col, max_col = array("q"), array("q"), array("q")
    tenant_ids: dict[str, int] = {}
    tier_of_tenant: list[str] = []
    seen: set[tuple[str, int]] = set()
    end_ms = -math.inf
    try:
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    u = decoder.decode(line)
                except msgspec.DecodeError as e:
                    msg = f"not a Usage record: {e}"
                    raise WorkloadError(source, f"line {lineno}", msg) from None
                if (u.request_id, u.attempt) in seen:
                    continue
                seen.add((u.request_id, u.attempt))
                tenant = tenant_ids.get(u.tenant)
                if tenant is None:
                    tenant = tenant_ids[u.tenant] = len(tier_of_tenant)
                    tier_of_tenant.append(u.tier)
                output = max(1, u.completion_tokens)
                start_ms.append(u.ts_ms - u.e2e_ms - u.queue_ms)
                tenant_col.append(tenant)
                prompt_col.append(max(1, u.prompt_tokens))
                output_col.append(output)
                max_col.append(2 * output + 16 if u.finish_reason == "stop" else output)
                end_ms = max(end_ms, u.ts_ms)
    except OSError as e:
        raise WorkloadError(source, "", f"cannot read: {e}") from e
    if not start_ms:
        raise WorkloadError(source, "", "no Usage records")

    tier_list = _usage_tiers(source, tiers, tier_of_tenant)
    tf, cfg = _scheduler_config(source, tier_list, pool, {}, {})
    table = TenantTable(tiers=[t.name for t in cfg.tiers])
    tier_index = {name: i for i, name in enumerate(table.tiers)}
    for name, i in tenant_ids.items():
        cfg.tenants[name] = TenantConfig(name=name, tier=tier_of_tenant[i])
        table.add(name, tier_index[tier_of_tenant[i]])

    order = sorted(range(len(start_ms)), key=start_ms.__getitem__)
    t0_ms = start_ms[order[0]]
    t_col = array("d", ((start_ms[i] - t0_ms) / 1000.0 for i in order))
    replay = _Replay(t_col, *(array("q", (col[i] for i in order))
                              for col in (tenant_col, prompt_col, output_col, max_col)))
    # Past the last arrival, so that one is inside [0, duration_s) too.
    duration_s = max((end_ms - t0_ms) / 1000.0, t_col[-1] + 0.001)
    return Workload(duration_s=duration_s, seed=0, tenants=table, scheduler_config=cfg,
                    replay=replay, source=source)


def _usage_tiers(source: str, tiers: list[Any] | None, found: list[str]) -> list[Any]:
    if tiers is None:
        return [{"name": name} for name in sorted(set(found))]
    if not isinstance(tiers, list) or not tiers:
        raise WorkloadError(source, "tiers", f"expected a non-empty list, got {kind_of(tiers)}")
    entries = [{"name": t} if isinstance(t, str) else t for t in tiers]
    names = {e.get("name") for e in entries if isinstance(e, dict)}
    for name in dict.fromkeys(found):
        if name not in names:
            raise WorkloadError(source, "tiers", f"the records' tier {name!r} is not listed")
    return entries

