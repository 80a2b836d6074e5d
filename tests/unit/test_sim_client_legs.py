"""The clients' legs in the fleet simulator (`FleetSettings.client_ms`, `--client-ms`).

A leg is added to what a request's client sees (its TTFT, end-to-end and token times)
and changes nothing the fleet decides: every run below is compared, request by
request, with the same arrivals run without legs.
"""

from __future__ import annotations

import math
import random

import pytest

from fleetsim.cli import cmd_simulate, parse_client_ms
from fleetsim.fleet import FleetSettings
from fleetsim.records import Arrival
from fleetsim.state import SettingError
from tests.unit.test_sim_fleet import config, run, table

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def arrivals(n: int = 300, seed: int = 5) -> list[Arrival]:
    rng = random.Random(seed)
    # Distinct arrival times: a request is known by its arrival in the sink's records.
    return [Arrival(i * 0.02 + rng.uniform(0, 0.01), rng.randrange(2), rng.randint(8, 256),
                    rng.randint(1, 200), 256) for i in range(n)]


def by_arrival(sink) -> dict[float, float]:
    """Each request's TTFT, by its arrival time."""
    return {round(arr, 6): ttft for xs in sink.ttft.values() for arr, ttft in xs}


def legs_of(client_ms: tuple[float, ...], seed: int = 0) -> tuple[dict[float, float], object, object]:
    """Each request's TTFT shift against the same run without legs, and both sinks."""
    t = table("a", "b")
    arr = arrivals()
    _, plain = run(arr, t, config(t), 60.0)
    _, legs = run(arr, t, config(t), 60.0, client_ms=client_ms, client_seed=seed)
    base, shifted = by_arrival(plain), by_arrival(legs)
    assert base.keys() == shifted.keys() and len(base) == len(arr)
    return {k: round((shifted[k] - base[k]) * 1000, 6) for k in base}, plain, legs


def test_a_constant_leg_adds_to_every_client_time_and_changes_no_decision():
    shift, plain, legs = legs_of((4.5,))
    assert set(shift.values()) == {4.5}
    # End-to-end and finish times move by the same; tokens, preemptions, order: the same.
    assert len(plain.finished) == len(legs.finished)
    for p, q in zip(sorted(plain.finished), sorted(legs.finished), strict=True):
        assert q[0] == p[0] and q[3:] == p[3:]
        assert q[1] == pytest.approx(p[1] + 0.0045) and q[2] == pytest.approx(p[2] + 0.0045)
    assert dict(legs.tokens) == pytest.approx(dict(plain.tokens))


def test_measured_legs_are_drawn_per_request_from_the_samples_and_seeded():
    samples = (1.0, 2.5, 9.0)
    shift, _, _ = legs_of(samples, seed=1)
    assert set(shift.values()) == set(samples)  # each drawn, nothing else
    counts = [list(shift.values()).count(s) for s in samples]
    assert min(counts) > len(shift) / 6  # ~a third each of 300
    again, _, _ = legs_of(samples, seed=1)
    other, _, _ = legs_of(samples, seed=2)
    assert again == shift and other != shift


def test_no_legs_is_the_fleet_as_before():
    shift, _, _ = legs_of(())
    assert set(shift.values()) == {0.0}


@pytest.mark.parametrize("bad", [(-1.0,), (1.0, math.nan), (math.inf,)])
def test_a_leg_that_is_negative_or_not_finite_is_refused(bad):
    with pytest.raises(SettingError) as e:
        FleetSettings(client_ms=bad)
    assert e.value.name == "client_ms"


def test_client_ms_flag_reads_a_value_a_list_or_a_file(tmp_path):
    assert parse_client_ms("5") == (5.0,)
    assert parse_client_ms("4.1, 5.3,6") == (4.1, 5.3, 6.0)
    f = tmp_path / "legs.txt"
    f.write_text("4.0\n4.5\n\n7.25\n")
    assert parse_client_ms(f"@{f}") == (4.0, 4.5, 7.25)
    with pytest.raises(ValueError, match="not a number: 'x'"):
        parse_client_ms("4,x")
    with pytest.raises(ValueError, match="no values"):
        parse_client_ms(" ,")


@pytest.mark.parametrize("flag,says", [("4,-1", "--client-ms: must be finite numbers >= 0"),
                                       ("4,x", "--client-ms: not a number: 'x'"),
                                       ("@/nonexistent/legs", "--client-ms: [Errno 2]")])
def test_a_bad_client_ms_flag_is_answered_before_anything_runs(flag, says, capsys, tmp_path):
    assert cmd_simulate(["bench/workloads/fidelity_steady.yaml", "--client-ms", flag,
                         "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_simulate_reports_the_legs_in_every_client_latency(tmp_path):
    """`fairlane simulate --client-ms 50`: every tier's mean TTFT and end-to-end 50 ms
    later (its percentiles too, within the histograms' 1% bins), the same requests."""
    from tests.unit.test_sim_cli import run as simulate

    plain, legs = simulate(tmp_path), simulate(tmp_path, "--client-ms", "50")
    for tier in ("paid", "free"):
        p, q = plain["summary"]["by_tier"][tier], legs["summary"]["by_tier"][tier]
        for metric in ("ttft_s", "e2e_s"):
            assert q[metric]["n"] == p[metric]["n"]
            assert q[metric]["mean"] - p[metric]["mean"] == pytest.approx(0.050)
    paid = plain["summary"]["by_tier"]["paid"]["ttft_s"]["p50"]  # ~20 ms: fine bins
    assert legs["summary"]["by_tier"]["paid"]["ttft_s"]["p50"] - paid == \
        pytest.approx(0.050, abs=0.02 * (paid + 0.050))
    assert legs["meta"]["client_ms"] == "50"
    assert "client_ms" not in plain["meta"]
    assert legs["meta"]["arrivals"] == plain["meta"]["arrivals"]
    assert legs["meta"]["preemptions_ordered"] == plain["meta"]["preemptions_ordered"]


def test_pools_draw_their_legs_the_same_in_any_number_of_processes():
    """`--pools`: each pool draws from its own seed (the workload's and its index), so a
    split run's report is one whatever runs the pools; a constant leg moves every
    pool's TTFTs by itself."""
    from fleetsim.pools import run_pools
    from tests.unit.test_sim_pools import NoStop, job

    apart = run_pools(job(2, client_ms=(1.0, 9.0)), 2, NoStop())
    here = run_pools(job(2, client_ms=(1.0, 9.0)), 1, NoStop())
    assert apart is not None and here is not None
    assert apart.recorder.summary() == here.recorder.summary()
    plain = run_pools(job(2), 1, NoStop())
    shifted = run_pools(job(2, client_ms=(7.0,)), 1, NoStop())
    assert plain is not None and shifted is not None
    p, q = plain.recorder.summary()["pool"], shifted.recorder.summary()["pool"]
    assert q["ttft_s"]["n"] == p["ttft_s"]["n"]
    assert q["ttft_s"]["mean"] - p["ttft_s"]["mean"] == pytest.approx(0.007)
