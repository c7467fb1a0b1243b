"""pipeoff._held_interrupt: a Ctrl-C held back during a block, passed on after it; a
second one passed on at once (a hang inside a hold must not trap the user)."""

from __future__ import annotations

import signal

import pytest

from pipeoff._held_interrupt import HeldInterrupt


def test_one_ctrl_c_is_held_until_delivered() -> None:
    held = HeldInterrupt()
    ran = []
    with held.hold():
        signal.raise_signal(signal.SIGINT)
        ran.append("after")
    assert ran == ["after"]
    with pytest.raises(KeyboardInterrupt) as info:
        held.deliver("pipeoff: note")
    assert info.value.__notes__ == ["pipeoff: note"]


def test_a_second_ctrl_c_goes_through_at_once() -> None:
    held = HeldInterrupt()
    ran = []
    with pytest.raises(KeyboardInterrupt), held.hold():
        signal.raise_signal(signal.SIGINT)
        ran.append("after the first")
        signal.raise_signal(signal.SIGINT)
        ran.append("after the second")
    assert ran == ["after the first"]
    held.deliver("nothing is left to deliver")  # (the first was passed on with it)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
