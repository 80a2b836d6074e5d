"""The tenants file's admin section: operators' keys for the streamer's admin endpoints
(/dashboard, /metrics), hashed like tenants' keys and never a tenant's key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairlane.tenants import TenantsFileError, default_tenants, hash_api_key, tenants_from_dict

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

DEMO = Path(__file__).resolve().parents[2] / "fairlane" / "demo_tenants.yaml"
ACME_KEY = "sk-acme"


def _doc(admin_keys: list[str] | None = None) -> dict:
    doc: dict = {"tenants": {"acme": {"api_keys": [hash_api_key(ACME_KEY)]}, "globex": {}}}
    if admin_keys is not None:
        doc["admin"] = {"api_keys": admin_keys}
    return doc


def _refused(doc: dict, match: str) -> str:
    with pytest.raises(TenantsFileError) as err:
        tenants_from_dict(doc, source="t.yaml")
    assert str(err.value).startswith("t.yaml: " + match), str(err.value)
    return str(err.value)


def test_admin_keys_are_hashed_and_are_no_tenants_keys():
    f = tenants_from_dict(_doc([hash_api_key("sk-op"),
                                "sha256:" + hash_api_key("sk-op-2")[7:].upper()]))
    assert f.num_admin_keys == 2 and f.is_admin_key("sk-op") and f.is_admin_key("sk-op-2")
    assert not f.is_admin_key(ACME_KEY) and not f.is_admin_key("")
    assert not f.is_admin_key(hash_api_key("sk-op"))  # the stored hash is not itself a key
    assert f.lookup_key("sk-op") is None  # an admin key submits nothing
    assert f.lookup_key(ACME_KEY).name == "acme"
    assert not tenants_from_dict(_doc()).is_admin_key("sk-op")  # no section: no admin
    assert tenants_from_dict(_doc()).num_admin_keys == 0
    assert not default_tenants().is_admin_key("sk-op")


def test_admin_section_errors_name_the_field_and_never_echo_a_key():
    _refused(_doc([hash_api_key("sk-op"), "sha256:" + "0" * 63]),
             "admin.api_keys[1]: malformed hashed key")
    err = _refused(_doc(["sk-live-SECRET"]), "admin.api_keys[0]: looks like a plain-text API key")
    assert "SECRET" not in err
    _refused(_doc([hash_api_key(ACME_KEY)]),
             "admin.api_keys[0]: duplicate API key hash (also tenant 'acme'")
    _refused(_doc([hash_api_key("sk-op")] * 2), "admin.api_keys[1]: duplicate API key hash")
    _refused({"admin": {"keys": []}}, "admin: object contains unknown field `keys`")
    _refused({"admin": ["x"]}, "admin: expected a mapping")


def test_the_demo_file_has_a_documented_admin_key():
    from fairlane.tenants import load_tenants

    f = load_tenants(DEMO)
    assert "sk-admin-demo" in DEMO.read_text() and f.is_admin_key("sk-admin-demo")
    assert f.lookup_key("sk-admin-demo") is None
