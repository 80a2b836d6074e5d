"""The pure lease state machine: acquire / renew / fence / lose, time passed in."""

from __future__ import annotations

import pytest

from dispatcher.leader import LeaseMachine, Role

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_standby_does_not_lead_and_polls():
    m = LeaseMachine(ttl_ms=3000)
    assert not m.leading(0)
    assert m.epoch == 0
    assert m.next_action_ms(0) == pytest.approx(1000)


def test_acquire_sets_epoch_and_renew_schedule():
    m = LeaseMachine(ttl_ms=3000)
    m.acquired(revision=7, sent_ms=100)
    assert m.role is Role.LEADER and m.epoch == 7
    assert m.leading(100)
    assert m.next_action_ms(600) == pytest.approx(500)  # renew at ttl/3 after the write


def test_renew_keeps_epoch_and_extends_lease():
    m = LeaseMachine(ttl_ms=3000)
    m.acquired(revision=7, sent_ms=0)
    m.renewed(revision=9, sent_ms=2000)
    assert m.epoch == 7 and m.revision == 9
    assert m.leading(4000)  # 2000 ms after the last write < 0.8 * ttl


def test_leader_fences_itself_before_the_ttl_lapses():
    m = LeaseMachine(ttl_ms=3000)
    m.acquired(revision=5, sent_ms=0)
    assert m.leading(2399)
    assert not m.leading(2400)  # 0.8 * ttl: a standby can only take over at ttl
    assert m.role is Role.STANDBY


def test_fence_counts_from_send_time_not_reply_time():
    m = LeaseMachine(ttl_ms=1000)
    m.acquired(revision=1, sent_ms=0)
    m.renewed(revision=2, sent_ms=100)  # the reply came late; the TTL started at 100
    assert not m.leading(900)


def test_lost_and_late_renew_are_ignored():
    m = LeaseMachine(ttl_ms=3000)
    m.acquired(revision=3, sent_ms=0)
    m.lost()
    m.renewed(revision=4, sent_ms=10)  # a reply racing the loss does not resurrect us
    assert not m.leading(10)


def test_a_later_acquisition_has_a_higher_epoch():
    old, new = LeaseMachine(ttl_ms=3000), LeaseMachine(ttl_ms=3000)
    old.acquired(revision=3, sent_ms=0)
    old.renewed(revision=10, sent_ms=1000)
    new.acquired(revision=11, sent_ms=5000)  # revisions are stream sequence numbers
    assert new.epoch > old.epoch


def test_worker_refuses_an_older_epoch():
    from gpu_worker.epoch import EpochGuard

    g = EpochGuard()
    assert g.admit(0)  # no election seen yet
    assert g.admit(5)
    assert not g.admit(3)  # a deposed leader's late answer
    assert not g.admit(0)  # an unelected dispatcher after an elected one
    assert g.admit(5) and g.admit(9)
    assert not g.admit(5)
