"""bench/calibrate_gpu.py's code path on the CPU (`--tiny`: a two-layer model): the
step model it writes loads, and the fit is the least-squares one it reports."""

from __future__ import annotations

import json
import sys

import pytest

from gpu_worker.sim.step_model import load_step_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def test_tiny_run_writes_a_loadable_step_model(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from bench import calibrate_gpu

    monkeypatch.setattr(sys, "argv", ["calibrate_gpu.py", "--tiny", "--out-dir", str(tmp_path),
                                      "--commit", "abc1234"])
    assert calibrate_gpu.main() == 0
    model = load_step_model(str(tmp_path / "tiny_smoke.json"))
    assert model.measured is False  # a smoke run says it is not a measurement
    doc = json.loads((tmp_path / "calibrate_gpu.json").read_text())
    assert doc["meta"]["commit"] == "abc1234"
    fit = doc["data"]["decode_fit"]
    for d in doc["data"]["decode"]:
        want = fit["base"] + fit["per_seq"] * d["num_running"] + \
            fit["per_kv_token"] * d["kv_tokens"]
        assert d["fit_ms"] == pytest.approx(want)
    assert min(fit.values()) >= 0  # non-negative coefficients


def test_lstsq_drops_a_negative_coefficient_and_refits():
    pytest.importorskip("torch")
    from bench.calibrate_gpu import lstsq

    # y = 2 + 3x exactly, plus a column whose free fit would be negative.
    rows = [[1.0, x, z] for x, z in ((0, 1), (1, 0), (2, 3), (3, 1), (4, 5))]
    ys = [2 + 3 * x - 0.5 * z for _, x, z in rows]
    fit = lstsq(rows, ys, ["a", "b", "c"])
    assert fit["c"] == 0.0 and fit["a"] >= 0 and fit["b"] > 0
    assert lstsq([[1.0, x] for x in range(5)], [2 + 3 * x for x in range(5)],
                 ["a", "b"]) == pytest.approx({"a": 2.0, "b": 3.0})
