"""bench/cpu_layout.py: which cores the vLLM engine gets to itself in the benches."""

from __future__ import annotations

import argparse
import os

import pytest

from bench.cpu_layout import (
    add_engine_cpus_arg,
    describe,
    engine_cpus_of,
    omp_bind,
    parse_engine_cpus,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


@pytest.mark.parametrize(
    ("spec", "num_cpus", "expected"),
    [
        ("last", 2, {1}),
        ("last", 16, {15}),
        ("last", 1, set()),  # one core cannot be split: shared
        ("none", 2, set()),
        ("1", 2, {1}),
        ("2-3", 8, {2, 3}),
        ("0,2-3", 8, {0, 2, 3}),
        (" LAST ", 4, {3}),
    ],
)
def test_engine_cpus_are_parsed(spec, num_cpus, expected):
    assert parse_engine_cpus(spec, num_cpus) == frozenset(expected)


@pytest.mark.parametrize(
    ("spec", "num_cpus", "message"),
    [
        ("0-1", 2, "leaves no core"),
        ("2", 2, "not among"),
        ("3-1", 8, "backwards"),
        ("one", 2, "expected none, last"),
        ("", 2, "expected none, last"),
    ],
)
def test_a_layout_that_cannot_work_is_refused(spec, num_cpus, message):
    with pytest.raises(ValueError, match=message):
        parse_engine_cpus(spec, num_cpus)


def test_openmp_binds_to_the_engine_cores_or_to_none_when_shared():
    assert omp_bind(frozenset({3, 2})) == "2,3"
    assert omp_bind(frozenset()) == "nobind"


def test_the_layout_is_described_for_the_results_file():
    assert describe(frozenset({1}), 2) == (
        "engine isolated: vLLM's processes on core(s) [1], everything else on [0]")
    assert describe(frozenset(), 2).startswith("shared")


def test_the_benches_option_parses_or_is_a_usage_error():
    parser = argparse.ArgumentParser()
    add_engine_cpus_arg(parser)
    assert engine_cpus_of(parser, parser.parse_args([])) == parse_engine_cpus("last", _cpus())
    assert engine_cpus_of(parser, parser.parse_args(["--engine-cpus", "none"])) == frozenset()
    with pytest.raises(SystemExit) as exc:
        engine_cpus_of(parser, parser.parse_args(["--engine-cpus", "one"]))
    assert exc.value.code == 2


def _cpus() -> int:
    return os.cpu_count() or 1
