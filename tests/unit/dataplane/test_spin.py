"""The busy-wait budget of the data plane's sockets: spin through short waits, sleep through long ones."""

from meshrl.dataplane.rpc import SPIN_CAP_S, SPIN_FLOOR_S, Spin


def test_spin_follows_the_recent_waits() -> None:
    spin = Spin()
    assert spin.budget() == SPIN_FLOOR_S  # nothing seen yet: the short default
    for _ in range(4):
        spin.record(100e-6)
    assert spin.budget() == 125e-6  # a little longer than the longest recent wait
    spin.record(10.0)  # one long wait (an idle spell): stop spinning until it ages out
    assert spin.budget() == SPIN_FLOOR_S
    for _ in range(3):
        spin.record(20e-6)
    assert spin.budget() == SPIN_FLOOR_S
    spin.record(20e-6)
    assert spin.budget() == 25e-6
    for _ in range(4):
        spin.record(SPIN_CAP_S)  # waits near the cap are not worth a core either
    assert spin.budget() == SPIN_FLOOR_S
