from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from fairlane.poolconfig import PreemptionConfig, SchedulerConfig, TenantConfig, TierConfig
from fairlane.tenants import (
    TenantsFileError,
    TenantsWatcher,
    _main,
    default_tenants,
    hash_api_key,
    load_tenants,
    parse_tenants,
    resolve_pool_config,
    tenants_from_dict,
)

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "fairlane" / "demo_tenants.yaml"
ACME_KEY = "sk-acme-demo"


def base() -> dict:
    """A small valid document; tests mutate a fresh copy."""
    return {
        "tiers": [
            {"name": "enterprise", "floor_share": 0.5, "engine_priority": 0},
            {"name": "paid", "floor_share": 0.3, "aging_ms": 1000, "engine_priority": 5},
            {"name": "free", "aging_ms": 5000, "engine_priority": 10},
        ],
        "pools": {
            "default": {"policy": "drr", "cost_model": "tokens", "quantum": 512},
            "batch": {"policy": "vtc", "allow_unknown_tenants": True, "default_tier": "paid"},
        },
        "tenants": {
            "acme": {
                "tier": "paid",
                "weight": 2,
                "max_concurrent": 4,
                "max_kv_tokens": 10000,
                "max_queued": 50,
                "requests_per_min": 60,
                "tokens_per_min": 1000,
                "api_keys": [hash_api_key(ACME_KEY)],
            },
            "globex": {"tier": "enterprise", "pools": ["default"]},
            "hobbyist": {},
        },
    }


def write(tmp_path: Path, doc: dict, name: str = "tenants.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return p


# --- valid files ---


def test_example_file_loads_and_builds_scheduler_config():
    f = load_tenants(EXAMPLE)
    assert [t.name for t in f.tiers] == ["enterprise", "paid", "free"]
    cfg = resolve_pool_config(f, "default")
    assert isinstance(cfg, SchedulerConfig)
    assert (cfg.policy, cfg.cost_model) == ("drr", "tokens")
    assert cfg.tenants["acme"].tier == "paid" and cfg.tenants["acme"].weight == 2.0
    assert cfg.tenants["globex"].tier == "enterprise"
    assert cfg.tenants["hobbyist"].tier == "free"
    assert f.lookup_key("sk-acme-demo").name == "acme"
    assert f.lookup_key("sk-globex-demo").name == "globex"
    assert f.lookup_key("sk-hobbyist-demo").name == "hobbyist"


def test_round_trip_to_scheduler_config(tmp_path):
    f = load_tenants(write(tmp_path, base()))
    cfg = resolve_pool_config(f, "default")
    assert cfg.policy == "drr" and cfg.cost_model == "tokens" and cfg.quantum == 512.0
    assert cfg.tiers == [
        TierConfig(name="enterprise", floor_share=0.5, aging_ms=0.0, engine_priority=0),
        TierConfig(name="paid", floor_share=0.3, aging_ms=1000.0, engine_priority=5),
        TierConfig(name="free", floor_share=0.0, aging_ms=5000.0, engine_priority=10),
    ]
    assert cfg.tenants["acme"] == TenantConfig(
        name="acme", tier="paid", weight=2.0, max_concurrent=4, max_kv_tokens=10000,
        max_queued=50, requests_per_min=60, tokens_per_min=1000,
    )
    # A tenant with no tier lands in the lowest one.
    assert cfg.tenants["hobbyist"].tier == "free"
    # One default everywhere: a pool that says nothing lets unlisted tenants in.
    assert cfg.allow_unknown_tenants is SchedulerConfig().allow_unknown_tenants is True
    assert cfg.tenant("stranger").tier == "free"
    assert cfg.default_tenant.tier == "free"
    assert cfg.max_queued_total == 1_000_000


def test_pool_restrictions_and_pool_defaults(tmp_path):
    f = load_tenants(write(tmp_path, base()))
    batch = resolve_pool_config(f, "batch")
    assert batch.policy == "vtc" and batch.cost_model == "requests"
    assert "globex" not in batch.tenants  # restricted to pool "default"
    assert set(batch.tenants) == {"acme", "hobbyist"}
    assert batch.allow_unknown_tenants is True
    stranger = batch.tenant("stranger")
    assert stranger is not None and stranger.tier == "paid"
    assert f.tenant("globex").allows_pool("default")
    assert not f.tenant("globex").allows_pool("batch")
    with pytest.raises(KeyError, match="nope"):
        resolve_pool_config(f, "nope")


def test_scheduler_config_is_fresh_each_call(tmp_path):
    f = load_tenants(write(tmp_path, base()))
    a = resolve_pool_config(f, "default")
    a.tenants.clear()
    a.tiers.clear()
    b = resolve_pool_config(f, "default")
    assert b.tenants["acme"].weight == 2.0 and len(b.tiers) == 3


def test_tenant_record_has_rate_limits(tmp_path):
    f = load_tenants(write(tmp_path, base()))
    acme = f.tenant("acme")
    assert (acme.requests_per_min, acme.tokens_per_min) == (60, 1000)
    assert f.tenant("hobbyist").requests_per_min is None


def test_request_limits_override_only_what_is_set(tmp_path):
    doc = base()
    doc["pools"]["default"]["max_tokens"] = 256
    f = load_tenants(write(tmp_path, doc))
    lim = f.request_limits("default")
    assert lim.max_tokens == 256 and lim.max_prompt_tokens == 32_768
    assert f.request_limits("batch").max_tokens == 4096


def test_toml_file(tmp_path):
    p = tmp_path / "tenants.toml"
    p.write_text(
        f"""
[[tiers]]
name = "gold"
floor_share = 0.25

[[tiers]]
name = "bronze"

[pools.default]
policy = "fifo"

[tenants.acme]
tier = "gold"
weight = 3.5
api_keys = ["{hash_api_key(ACME_KEY)}"]
""",
        encoding="utf-8",
    )
    f = load_tenants(p)
    cfg = resolve_pool_config(f, "default")
    assert cfg.policy == "fifo"
    assert cfg.tenants["acme"].weight == 3.5 and cfg.tenants["acme"].tier == "gold"
    assert f.lookup_key(ACME_KEY).name == "acme"


def test_preemption_settings_per_pool(tmp_path):
    doc = base()
    knobs = {"preempt_after_ms": 500, "min_run_ms": 2000, "max_per_s": 5, "max_per_request": 1}
    doc["pools"]["default"]["preemption"] = knobs
    doc["pools"]["batch"]["preemption"] = {"enabled": False}
    f = load_tenants(write(tmp_path, doc))
    assert resolve_pool_config(f, "default").preemption == PreemptionConfig(**knobs)
    batch = resolve_pool_config(f, "batch").preemption
    assert not batch.enabled and batch.min_run_ms == PreemptionConfig().min_run_ms
    # Left out: the same defaults as a SchedulerConfig built in code.
    assert resolve_pool_config(default_tenants(), "default").preemption == \
        SchedulerConfig().preemption == PreemptionConfig()
    p = tmp_path / "t.toml"
    p.write_text('[pools.default.preemption]\nmin_run_ms = 250\n', encoding="utf-8")
    assert resolve_pool_config(load_tenants(p), "default").preemption.min_run_ms == 250.0


def test_minimal_and_empty_documents():
    f = parse_tenants("tenants: {acme: {}}\n")
    assert [t.name for t in f.tiers] == ["standard"]
    cfg = resolve_pool_config(f, "default")
    assert cfg.policy == "drr" and cfg.tenants["acme"].tier == "standard"
    assert tenants_from_dict(None).tenants == {}


def test_default_config_runs_with_no_file():
    f = default_tenants()
    assert f.is_default and f.num_api_keys == 0
    cfg = resolve_pool_config(f, "default")
    assert cfg.policy == "drr"
    assert [t.name for t in cfg.tiers] == ["standard"]
    assert cfg.allow_unknown_tenants is True
    assert cfg.tenant("anyone").tier == "standard"
    assert f.lookup_key("sk-anything") is None


# --- validation errors ---


def _err(doc, match: str, tmp_path: Path) -> TenantsFileError:
    p = write(tmp_path, doc)
    with pytest.raises(TenantsFileError) as ei:
        load_tenants(p)
    msg = str(ei.value)
    assert msg.startswith(str(p) + ": "), msg
    assert match in msg, msg
    return ei.value


def _set(doc: dict, path: tuple, value) -> dict:
    cur = doc
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return doc


PRE = ("pools", "default", "preemption")


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("tenants", "acme", "weight"), 0, "tenants.acme.weight: must be > 0, got 0"),
        (("tenants", "acme", "weight"), -1.5, "tenants.acme.weight: must be > 0"),
        (("tenants", "acme", "weight"), float("inf"), "tenants.acme.weight: must be a finite"),
        (
            ("tenants", "acme", "weight"),
            "heavy",
            "tenants.acme.weight: expected `float`, got `str`",
        ),
        (("tenants", "acme", "weight"), True, "tenants.acme.weight: expected `float`, got `bool`"),
        (("tenants", "acme", "tier"), "gold", "tenants.acme.tier: unknown tier 'gold'"),
        (("tenants", "acme", "max_concurrent"), 0, "tenants.acme.max_concurrent: must be > 0"),
        (("tenants", "acme", "max_kv_tokens"), -1, "tenants.acme.max_kv_tokens: must be > 0"),
        (("tenants", "acme", "max_queued"), 1.5, "tenants.acme.max_queued: expected `int"),
        (("tenants", "acme", "requests_per_min"), 0, "tenants.acme.requests_per_min: must be > 0"),
        (("tenants", "acme", "tokens_per_min"), -5, "tenants.acme.tokens_per_min: must be > 0"),
        (("tenants", "acme", "pools"), ["gpu"], "tenants.acme.pools[0]: unknown pool 'gpu'"),
        (("tenants", "acme", "api_keys"), "sha256:x", "tenants.acme.api_keys: expected `array`"),
        (
            ("tenants", "acme", "colour"),
            "red",
            "tenants.acme: object contains unknown field `colour`",
        ),
        (("tenants", "acme"), [], "tenants.acme: expected a mapping, got a list"),
        (("tenants", "bad.name"), {}, "tenants.bad.name: tenant id 'bad.name' is invalid"),
        (("tenants", "a b"), {}, "tenant id 'a b' is invalid"),
        (("tenants", 123), {}, "tenant id must be a string, got int"),
        (("tenants",), [], "tenants: expected a mapping, got a list"),
        (("tiers", 0, "floor_share"), 1.5, "tiers[0].floor_share: must be in [0, 1], got 1.5"),
        (("tiers", 0, "floor_share"), -0.1, "tiers[0].floor_share: must be in [0, 1]"),
        (("tiers", 1, "aging_ms"), -1, "tiers[1].aging_ms: must be >= 0, got -1"),
        (("tiers", 1, "engine_priority"), 1.5, "tiers[1].engine_priority: expected `int`"),
        (("tiers", 1, "name"), "enterprise", "tiers[1].name: duplicate tier 'enterprise'"),
        (("tiers", 1, "name"), "pa*id", "tiers[1].name: tier name 'pa*id' is invalid"),
        (("tiers", 2), {"floor_share": 0.1}, "tiers[2]: object missing required field `name`"),
        (("tiers", 2, "floor_share"), 0.5, "tiers: floor_share values must sum to <= 1, got 1.3"),
        (("tiers",), [], "tiers: must list at least one tier"),
        (("tiers",), {"gold": {}}, "tiers: expected a list (highest tier first), got a mapping"),
        (
            ("pools", "default", "policy"),
            "lottery",
            "pools.default.policy: invalid enum value 'lottery' (expected one of: drr, fifo, vtc)",
        ),
        (
            ("pools", "default", "cost_model"),
            "joules",
            "cost_model: invalid enum value 'joules' (expected one of: kv_seconds, requests, tokens)",
        ),
        (("pools", "default", "quantum"), 0, "pools.default.quantum: must be > 0, got 0"),
        (("pools", "default", "max_tokens"), 0, "pools.default.max_tokens: must be > 0"),
        (("pools", "default", "max_prompt_tokens"), -1, "pools.default.max_prompt_tokens: must be"),
        (
            ("pools", "default", "max_queued_total"),
            0,
            "pools.default.max_queued_total: must be > 0",
        ),
        (("pools", "default", "allow_unknown_tenants"), "yes please", "expected `bool`"),
        (("pools", "default", "default_tier"), "gold", "pools.default.default_tier: unknown tier"),
        (PRE, {"min_run_ms": -1}, "pools.default.preemption.min_run_ms: must be >= 0, got -1"),
        (PRE, {"preempt_after_ms": float("nan")}, "pools.default.preemption.preempt_after_ms: must be a finite"),
        (PRE, {"max_per_s": 0}, "pools.default.preemption.max_per_s: must be > 0, got 0"),
        (PRE, {"max_per_s": 2.5}, "pools.default.preemption.max_per_s: expected `int`"),
        (PRE, {"max_per_request": -2}, "pools.default.preemption.max_per_request: must be > 0"),
        (PRE, {"enabled": "yes"}, "pools.default.preemption.enabled: expected `bool`"),
        (PRE, {"after_ms": 5}, "pools.default.preemption: object contains unknown field"),
        (PRE, [], "pools.default.preemption: expected `object`, got `array`"),
        (("pools", "gpu.a"), {}, "pools.gpu.a: pool name 'gpu.a' is invalid"),
        (("pools",), {}, "pools: must define at least one pool"),
        (("models",), {}, "models: unknown section (expected one of: tiers, pools, tenants, admin)"),
    ],
)
def test_validation_errors_name_the_field(tmp_path, path, value, match):
    _err(_set(base(), path, value), match, tmp_path)


def test_top_level_must_be_a_mapping(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(TenantsFileError, match="expected a mapping at the top level, got a list"):
        load_tenants(p)


def test_invalid_yaml_names_the_file(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("tenants: {acme: [\n", encoding="utf-8")
    with pytest.raises(TenantsFileError, match=r"t\.yaml: invalid YAML"):
        load_tenants(p)


def test_invalid_toml_names_the_file(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[tenants\n", encoding="utf-8")
    with pytest.raises(TenantsFileError, match=r"t\.toml: invalid TOML"):
        load_tenants(p)


def test_duplicate_yaml_keys_are_refused(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("tenants:\n  acme: {weight: 1}\n  acme: {weight: 5}\n", encoding="utf-8")
    with pytest.raises(TenantsFileError, match="duplicate key 'acme'"):
        load_tenants(p)


def test_unknown_extension_and_missing_file(tmp_path):
    with pytest.raises(TenantsFileError, match="unknown extension '.json'"):
        load_tenants(tmp_path / "t.json")
    with pytest.raises(TenantsFileError, match="cannot read"):
        load_tenants(tmp_path / "absent.yaml")


# --- keys ---


def test_hash_api_key_format():
    h = hash_api_key(ACME_KEY)
    assert h.startswith("sha256:") and len(h) == 7 + 64
    assert h == hash_api_key(ACME_KEY) != hash_api_key(ACME_KEY + "x")


def test_lookup_key(tmp_path):
    f = load_tenants(write(tmp_path, base()))
    assert f.lookup_key(ACME_KEY).name == "acme"
    assert f.lookup_key("sk-wrong") is None
    assert f.lookup_key("") is None
    # The stored hash is not itself a key.
    assert f.lookup_key(hash_api_key(ACME_KEY)) is None
    assert f.num_api_keys == 1


def test_uppercase_hex_hash_is_accepted(tmp_path):
    doc = base()
    doc["tenants"]["acme"]["api_keys"] = ["sha256:" + hash_api_key(ACME_KEY)[7:].upper()]
    assert load_tenants(write(tmp_path, doc)).lookup_key(ACME_KEY).name == "acme"


def test_plaintext_key_is_refused_without_echoing_it(tmp_path):
    doc = base()
    doc["tenants"]["acme"]["api_keys"] = [hash_api_key("other"), "sk-live-SECRET-123"]
    err = _err(doc, "tenants.acme.api_keys[1]: looks like a plain-text API key", tmp_path)
    assert "hash" in str(err) and "hash-key" in str(err)
    assert "SECRET" not in str(err)


def test_malformed_hash_is_refused(tmp_path):
    doc = base()
    doc["tenants"]["acme"]["api_keys"] = ["sha256:abc123"]
    _err(doc, "tenants.acme.api_keys[0]: malformed hashed key", tmp_path)


def test_key_shared_by_two_tenants_is_refused(tmp_path):
    doc = base()
    doc["tenants"]["globex"]["api_keys"] = [hash_api_key(ACME_KEY)]
    _err(doc, "tenants.globex.api_keys[0]: duplicate API key hash (also used by 'acme')", tmp_path)


@given(st.text(min_size=1, max_size=64))
def test_any_key_round_trips_through_its_hash(key):
    f = tenants_from_dict({"tenants": {"t": {"api_keys": [hash_api_key(key)]}}})
    assert f.lookup_key(key).name == "t"


def test_cli_hashes_a_key(capsys):
    assert _main(["hash-key", ACME_KEY]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key(ACME_KEY)
    assert _main([]) == 2


# --- watcher ---


def _rewrite(p: Path, doc: dict, bump_s: int) -> None:
    p.write_text(yaml.safe_dump(doc), encoding="utf-8")
    st_ = p.stat()
    # Make the change visible even on filesystems with coarse mtimes.
    os.utime(p, ns=(st_.st_atime_ns, st_.st_mtime_ns + bump_s * 1_000_000_000))


def test_watcher_reloads_on_change(tmp_path):
    p = write(tmp_path, base())
    w = TenantsWatcher(p)
    assert w.current.tenant("acme").weight == 2.0
    assert w.maybe_reload() is False  # unchanged

    doc = base()
    doc["tenants"]["acme"]["weight"] = 7
    doc["tenants"]["newco"] = {"tier": "free"}
    _rewrite(p, doc, 1)
    with capture_logs() as logs:
        assert w.maybe_reload() is True
    assert w.current.tenant("acme").weight == 7.0
    assert resolve_pool_config(w.current, "default").tenants["newco"].tier == "free"
    assert w.last_error is None
    assert logs[0]["event"] == "tenants_reloaded" and logs[0]["num_tenants"] == 4
    assert w.maybe_reload() is False


def test_watcher_keeps_old_config_on_bad_edit(tmp_path):
    p = write(tmp_path, base())
    w = TenantsWatcher(p)
    good = w.current

    bad = base()
    bad["tenants"]["acme"]["weight"] = 0
    _rewrite(p, bad, 1)
    with capture_logs() as logs:
        assert w.maybe_reload() is False
        assert w.maybe_reload() is False  # same bad file: no retry, no second log line
    assert w.current is good
    assert "tenants.acme.weight: must be > 0" in str(w.last_error)
    assert len(logs) == 1
    assert logs[0]["event"] == "tenants_reload_failed"
    assert logs[0]["log_level"] == "warning"
    assert "tenants.acme.weight" in logs[0]["error"]

    # Fixing the file recovers.
    fixed = base()
    fixed["tenants"]["acme"]["weight"] = 3
    _rewrite(p, fixed, 2)
    assert w.maybe_reload() is True
    assert w.current.tenant("acme").weight == 3.0 and w.last_error is None


def test_watcher_survives_file_removal(tmp_path):
    p = write(tmp_path, base())
    w = TenantsWatcher(p)
    good = w.current
    p.unlink()
    with capture_logs() as logs:
        assert w.maybe_reload() is False
    assert w.current is good
    assert "file is missing" in str(w.last_error)
    assert logs[0]["event"] == "tenants_reload_failed"
    _rewrite(p, base(), 3)
    assert w.maybe_reload() is True


def test_watcher_first_load_fails_fast(tmp_path):
    bad = base()
    bad["tiers"][0]["floor_share"] = 2
    with pytest.raises(TenantsFileError, match="floor_share"):
        TenantsWatcher(write(tmp_path, bad))


def test_watcher_without_file_serves_the_default():
    w = TenantsWatcher(None)
    assert w.current.is_default
    assert w.maybe_reload() is False


@pytest.mark.unit
def test_default_config_serves_any_pool():
    cfg = resolve_pool_config(default_tenants(), "any-pool")
    assert cfg.policy == "drr" and cfg.allow_unknown_tenants
