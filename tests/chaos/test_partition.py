"""Issue 13, cluster chaos: one node of a 3-node NATS cluster cut off by a network
partition under load (`tests.chaos.scenarios_partition`), as a follower and as the
FL_REQUESTS stream leader. Asserts every check the scenario reports (0 lost, 0
generated twice, 0 failed but billed, every request answered, dispatching resumed,
the cut node caught up with the same stream state as the others). The gap these runs
found (`scenarios_partition.KNOWN_GAP`) is an expected failure while it is open, but
only when the checks that fail are its own: any other failing check fails the test.

Needs network namespaces (root: `ip netns add`); skipped, saying why, where they
cannot be made. Each run deletes its namespace and veth pair however it ends; the
fixture's finalizer deletes whatever this process still left behind.
"""

from __future__ import annotations

import pytest

from tests.chaos import netns
from tests.chaos.scenarios import PARTITION, Params, run_scenario
from tests.chaos.scenarios_partition import KNOWN_GAP_CHECKS
from tests.chaos.test_faults import QUICK, _summary

pytestmark = [pytest.mark.chaos]


@pytest.fixture
def namespaces():
    why = netns.unsupported()
    if why is not None:
        pytest.skip(f"network partition chaos needs network namespaces: {why}")
    yield
    netns.cleanup_ours()
    assert netns.ours() == ([], []), "a namespace or veth pair outlived its run"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", PARTITION)
async def test_partition(name: str, tmp_path, namespaces) -> None:
    params: Params = QUICK
    res = await run_scenario(name, params, tmp_path)
    failed = {c["name"] for c in res["checks"] if not c["ok"]}
    if failed and failed <= KNOWN_GAP_CHECKS:  # the gap found here, and nothing else
        pytest.xfail(f"KNOWN GAP: {res['known_gap']}\n{_summary(res)}")
    assert res["ok"], _summary(res)
