"""Chaos on a 3-node NATS cluster (issue 13): one node cut off by a network partition.

Node ``n3`` runs in a network namespace of its own (`tests.chaos.netns`), joined to the
host by a veth pair; ``n1``/``n2``, the dispatcher, the workers and the client stay on
the host (client ports on 127.0.0.1, routes on the host's end of the pair) and reach
``n3`` over the pair; every process is given all three URLs and connects to one of
them at random, as nats-py does. Under load the pair's namespace end goes down for
`CUT_S` (longer than the raft election timeout, 4-9 s: the majority side elects new
leaders), then comes back up. Nothing is killed: established connections to ``n3``
hang (no reset) and resume after the heal, and ``n3`` must catch up with the writes the
majority took meanwhile.

- `nats_partition_leader`: ``n3`` leads FL_REQUESTS when cut (moved there before the
  load with a leader step-down).
- `nats_partition_follower`: ``n3`` leads neither FL_REQUESTS nor the lease bucket.

Checks beyond the shared ones (0 lost, 0 generated twice, 0 failed but billed, every
request answered): dispatching resumes after the cut; every replica is current again
after the heal; and, once the load is answered, ``n3``'s own FL_REQUESTS and FL_USAGE
state (messages, first and last sequence, read from its monitoring port) equals the
other nodes'. Reported: which fleet connections were on ``n3`` when it was cut, the
stream leader during and after the cut, and the times.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import Iterator

from fairlane.natscluster import Isolated
from tests.chaos.harness import ChaosRun, FleetSpec, now
from tests.chaos.netns import Netns
from tests.chaos.scenario_base import Check, Params, Scenario, _check

NODE = "n3"  # the node in the namespace
CUT_S = 10.0
CATCH_UP_S = 30.0  # bound on the cut node becoming current again
STATE_MATCH_S = 30.0  # bound on its stream state matching the others' once the load is done
STREAMS = ("requests_stream", "usage_stream")  # `Subjects` attributes


def node_states(run: ChaosRun, stream: str) -> dict[str, tuple | None]:
    """Each node's own view of a stream (messages, first_seq, last_seq), from its
    monitoring port (None: unreadable or not there)."""
    out: dict[str, tuple | None] = {}
    for n in run.cluster.nodes:
        url = f"http://{n.host}:{n.monitor_port}/jsz?accounts=true&streams=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                jsz = json.loads(r.read())
        except (OSError, ValueError):
            out[n.server_name] = None
            continue
        st = next((s["state"] for a in jsz.get("account_details") or []
                   for s in a.get("stream_detail") or [] if s["name"] == stream), None)
        out[n.server_name] = (None if st is None else
                              (st["messages"], st["first_seq"], st["last_seq"]))
    return out


def connection_names(run: ChaosRun, node: str) -> list[str]:
    """The named client connections on a node (who will be cut off with it)."""
    n = run.cluster.node(node)
    try:
        with urllib.request.urlopen(f"http://{n.host}:{n.monitor_port}/connz?limit=1000",
                                    timeout=2) as r:
            conns = json.loads(r.read()).get("connections") or []
    except (OSError, ValueError):
        return ["<unreadable>"]
    return sorted(c.get("name") or "<unnamed>" for c in conns)


# What these scenarios found, fixed since (bench/results/chaos_partition.md, BENCHMARKS.md
# section 8): a process on the cut node waited the cut out (nats-py pinged every 2 min;
# now every connection pings every 2 s and fails over after 3 unanswered pings), a
# publish flushed late after the failover was answered `duplicate` to its own client or
# re-published as a second attempt (now: attached when the stored copy is ours), and a
# cut-off worker's late chunks could mix into a resumed stream (now: chunks carry their
# attempt). One cost stays and is reported, not failed: a worker cut off right after
# its last chunks (which the cut swallowed) is declared lost and the client resumes the
# tail elsewhere (`finished_attempt_resumed`: generated again, billed once).


class _NodePartition(Scenario):
    role = ""  # "leader" or "follower"

    def environment(self) -> contextlib.AbstractContextManager:
        return self._namespace()

    @contextlib.contextmanager
    def _namespace(self) -> Iterator[None]:
        with Netns() as ns:  # deleted (with its veth pair) however the run ends
            self.ns = ns
            yield

    def fleet(self, p: Params) -> FleetSpec:
        return FleetSpec(nats_cluster=3, isolated=Isolated(
            NODE, tuple(self.ns.exec_prefix), self.ns.ns_addr, self.ns.host_addr))

    async def _move_leader(self, run: ChaosRun, stream: str, want_cut_node: bool) -> str | None:
        """Step the stream's leader down until it is (or is not) the cut node; a few
        tries at most (each election picks a peer; `preferred` asks for one)."""
        for _ in range(8):
            leader = await run.stream_leader(stream)
            if leader is not None and (leader == NODE) == want_cut_node:
                return leader
            others = [n.server_name for n in run.cluster.nodes if n.server_name != leader]
            pick = NODE if want_cut_node else next(n for n in others if n != NODE)
            with contextlib.suppress(Exception):
                await run.obs.nc.request(
                    f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                    json.dumps({"placement": {"preferred": pick}}).encode(), timeout=5)
            await run.wait(lambda: run.stream_replicas_current(stream), 15,
                           f"a current {stream} after a step-down", interval_s=0.2)
        raise AssertionError(f"could not move {stream}'s leader (cut node wanted: "
                             f"{want_cut_node})")

    async def drive(self, run: ChaosRun, p: Params) -> None:
        requests = run.subjects.requests_stream
        lease = f"KV_{run.subjects.prefix}_leader"
        if self.role == "leader":
            await self._move_leader(run, requests, True)
        else:
            await self._move_leader(run, requests, False)
            await self._move_leader(run, lease, False)
        self.leader_before = await run.stream_leader(requests)
        self.lease_leader_before = await run.stream_leader(lease)
        load = self.load(run, p)
        await self.mid_run(run, p, worker=None)
        self.on_cut_node = connection_names(run, NODE)
        run.notes.append(f"cut {NODE} ({self.role}); FL_REQUESTS leader {self.leader_before}, "
                         f"lease bucket leader {self.lease_leader_before}; connections on "
                         f"{NODE}: {self.on_cut_node}")
        run.fault_t = now()
        try:
            await asyncio.to_thread(self.ns.cut)
            await asyncio.sleep(CUT_S - 1.0)
            self.leader_during = await run.stream_leader(requests)
            await asyncio.sleep(max(0.0, run.fault_t + CUT_S - now()))
        finally:
            await asyncio.to_thread(self.ns.heal)
        run.restore_t = now()
        self.caught_up_s = None
        while now() - run.restore_t < CATCH_UP_S:
            if await run.stream_replicas_current():
                self.caught_up_s = round(now() - run.restore_t, 2)
                break
            await asyncio.sleep(0.2)
        self.leader_after = await run.stream_leader(requests)
        await load
        # The stores compare only once writes stop: wait for the answers (bounded; the
        # shared analysis counts what stays unanswered), then for equal states.
        with contextlib.suppress(TimeoutError):
            await run.wait(lambda: all(r.done for r in run.requests.values()), 90,
                           "answers", interval_s=0.2)
        self.states: dict[str, dict] = {}
        self.states_match_s = None
        t0 = now()
        while now() - t0 < STATE_MATCH_S:
            self.states = {s: await asyncio.to_thread(node_states, run,
                                                      getattr(run.subjects, s))
                           for s in STREAMS}
            if all(None not in v.values() and len(set(v.values())) == 1
                   for v in self.states.values()):
                self.states_match_s = round(now() - t0, 2)
                break
            await asyncio.sleep(0.5)
        run.notes.append(f"FL_REQUESTS leader during the cut {self.leader_during}, after "
                         f"{self.leader_after}; {NODE} current {self.caught_up_s} s after the "
                         f"heal; node states {self.states}")

    def checks(self, run: ChaosRun, res: dict, out: list[Check]) -> None:
        _check(out, "every request completed", res["completed"] == res["submitted"],
               f"{res['completed']}/{res['submitted']} ({res['failed']})", "all")
        _check(out, "every request answered", res["lost"] == 0 and run.num_done() == len(
            run.requests), f"{run.num_done()}/{len(run.requests)}", "all")
        rec = res["recovery_s"]
        _check(out, "dispatching resumed after the cut",
               rec.get("fault_to_next_started") is not None,
               rec.get("fault_to_next_started"), "a start")
        _check(out, f"{NODE} current again after the heal (every FL_REQUESTS replica)",
               self.caught_up_s is not None, self.caught_up_s, f"<= {CATCH_UP_S} s")
        _check(out, f"{NODE}'s FL_REQUESTS and FL_USAGE state equals the other nodes'",
               self.states_match_s is not None,
               {s: {k: list(v) if v else v for k, v in st.items()}
                for s, st in self.states.items()}, "equal")
        if self.role == "leader":
            _check(out, "the majority side elected a new FL_REQUESTS leader during the cut",
                   self.leader_during not in (None, NODE), self.leader_during, "n1 or n2")
        firsts = [min(t for t, _, _ in run.obs.dispatched[r.rid]) for r in run.requests.values()
                  if r.attempts and r.attempts[0].submit_t > run.fault_t
                  and run.obs.dispatched.get(r.rid)]
        res["extra"] = {
            "cut_node": NODE, "role": self.role, "cut_s": CUT_S,
            "connections_on_cut_node": self.on_cut_node,
            "leader_before": self.leader_before, "leader_during": self.leader_during,
            "leader_after": self.leader_after, "lease_leader_before": self.lease_leader_before,
            "caught_up_s": self.caught_up_s, "states_match_s": self.states_match_s,
            "fault_to_first_new_dispatch_s":
                round(min(firsts) - run.fault_t, 3) if firsts else None,
            "restore_to_next_started": rec.get("restore_to_next_started")}


class NatsPartitionLeader(_NodePartition):
    name = "nats_partition_leader"
    fault = (f"3-node NATS cluster (R3): cut the node leading FL_REQUESTS off the network "
             f"(its veth down) for {CUT_S:.0f} s, then heal")
    role = "leader"


class NatsPartitionFollower(_NodePartition):
    name = "nats_partition_follower"
    fault = (f"3-node NATS cluster (R3): cut a node leading neither FL_REQUESTS nor the "
             f"lease bucket off the network (its veth down) for {CUT_S:.0f} s, then heal")
    role = "follower"
