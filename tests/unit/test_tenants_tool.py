"""`fairlane tenants check` and the tenants file's JSON Schema."""

from __future__ import annotations

import json

import msgspec
import pytest
import yaml

from fairlane.cli import DEMO_TENANTS, main
from fairlane.poolconfig import PoolSpec, TierConfig
from fairlane.tenants import hash_api_key
from fairlane.tenants_schema import _TenantSpec
from fairlane.tenants_tool import (
    SCHEMA_PATH,
    check_file,
    render_schema,
    tenants_json_schema,
    unused_hints,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

BAD = """
tiers:
  - {name: paid, floor_share: 0.7}
  - {name: free, floor_share: 0.6}
pools:
  default: {policy: lottery}
  small: {quantum: 0}
tenants:
  a: {tier: paid, weight: 0}
  b: {tier: gold, pools: [small]}
  c: {pools: [default, nope]}
  d: {api_keys: ["sk-plain-text"]}
  e: {tier: free}
extra: 1
"""


# --- the schema --------------------------------------------------------------------------


def test_committed_schema_is_the_generated_one():
    # Regenerate with: fairlane tenants schema > fairlane/tenants.schema.json
    assert SCHEMA_PATH.read_text(encoding="utf-8") == render_schema()
    assert json.loads(SCHEMA_PATH.read_text(encoding="utf-8")) == tenants_json_schema()


def test_schema_follows_the_loader_types():
    defs = tenants_json_schema()["$defs"]
    for name, cls in (("Tier", TierConfig), ("Pool", PoolSpec), ("Tenant", _TenantSpec)):
        fields = {f.name for f in msgspec.structs.fields(cls)}
        assert set(defs[name]["properties"]) == fields, name
        assert defs[name]["additionalProperties"] is False  # unknown fields are refused
    assert defs["Pool"]["properties"]["policy"]["enum"] == ["drr", "fifo", "vtc"]
    assert unused_hints() == []  # every range hint still names a real field


def test_schema_command_prints_it(capsys):
    assert main(["tenants", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == tenants_json_schema()


def test_demo_file_and_bad_entries_against_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = tenants_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    demo = yaml.safe_load(DEMO_TENANTS.read_text(encoding="utf-8"))
    assert list(validator.iter_errors(demo)) == []
    bad = yaml.safe_load(BAD)
    errors = list(_leaves(validator.iter_errors(bad)))
    paths = {"/".join(str(p) for p in e.absolute_path) for e in errors}
    assert {"pools/default/policy", "pools/small/quantum", "tenants/a/weight",
            "tenants/d/api_keys/0"} <= paths
    assert any("'extra' was unexpected" in e.message for e in errors)


def _leaves(errors):
    """The innermost errors (a failed anyOf reports its branches' errors as context)."""
    for e in errors:
        if e.context:
            yield from _leaves(e.context)
        else:
            yield e


# --- check -------------------------------------------------------------------------------


def test_check_accepts_the_demo_file(capsys):
    assert main(["tenants", "check", str(DEMO_TENANTS)]) == 0
    assert capsys.readouterr().out.startswith("ok: 3 tenants, 1 pool, 3 tiers")


def test_check_lists_every_independent_error(tmp_path, capsys):
    path = tmp_path / "tenants.yaml"
    path.write_text(BAD)
    assert main(["tenants", "check", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    where = [line.removeprefix(f"{path}: ").split(":")[0] for line in lines]
    assert where == ["extra", "tiers", "pools.default.policy", "pools.small.quantum",
                     "tenants.a.weight", "tenants.b.tier", "tenants.c.pools[1]",
                     "tenants.d.api_keys[0]"], lines
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert "sk-plain-text" not in "\n".join(lines)  # a pasted secret is never echoed


def test_check_errors_across_entries_and_whole_file_errors(tmp_path):
    key = hash_api_key("sk-shared")
    path = tmp_path / "t.yaml"
    path.write_text(f"tenants:\n  a: {{api_keys: ['{key}']}}\n  b: {{api_keys: ['{key}']}}\n")
    loaded, errors = check_file(path)
    assert loaded is None and len(errors) == 1 and "also used by 'a'" in errors[0]
    path.write_text("tenants: {a: {weight: 1}\n")  # not YAML
    assert check_file(path)[1][0].startswith(f"{path}: invalid YAML")
    assert check_file(tmp_path / "missing.yaml")[1][0].endswith("No such file or directory: "
                                                                 f"'{tmp_path / 'missing.yaml'}'")


def test_check_reads_toml_and_exit_1_if_any_file_fails(tmp_path, capsys):
    good = tmp_path / "t.toml"
    good.write_text('[[tiers]]\nname = "paid"\n\n[tenants.acme]\ntier = "paid"\n')
    bad = tmp_path / "t.yml"
    bad.write_text("tenants: {acme: {weight: -1}}\n")
    assert main(["tenants", "check", str(good)]) == 0
    assert capsys.readouterr().out.startswith("ok: 1 tenant, 1 pool, 1 tier")
    assert main(["tenants", "check", str(good), str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok:") and out[1] == f"{bad}: tenants.acme.weight: must be > 0, got -1.0"


def test_tenants_without_an_action_is_exit_2(capsys):
    assert main(["tenants"]) == 2
    assert "expected an action" in capsys.readouterr().err


def test_check_warns_of_a_quantum_below_one_request_under_a_token_cost(tmp_path, capsys):
    # Accepted (exit 0), but said: with cost_model tokens and the `requests` default
    # quantum (1) a quiet tenant is almost never owed a preemption.
    path = tmp_path / "t.yaml"
    path.write_text("pools:\n  chat: {policy: drr, cost_model: tokens}\n"
                    "  big: {policy: drr, cost_model: tokens, quantum: 1024}\n"
                    "  per_request: {policy: drr}\n  kv: {cost_model: kv_seconds, quantum: 10}\n"
                    "  fifo: {policy: fifo, cost_model: tokens}\n")
    assert main(["tenants", "check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok: ")
    warned = [line.removeprefix(f"{path}: warning: ").split(":")[0] for line in lines[1:]]
    assert warned == ["pools.chat.quantum", "pools.kv.quantum"], lines
    assert "under cost_model tokens" in lines[1]
