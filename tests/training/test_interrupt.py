"""`training.interrupt.InterruptWatch`: the first SIGINT interrupts, repeats are ignored, and
after a Ctrl-C they stay ignored (torchrun's forwarded copy may land after the clean-up)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_ext.training.interrupt import InterruptWatch


@pytest.fixture
def sigint_handler():
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_release_restores_the_previous_handler_when_no_signal_came(sigint_handler):
    watch = InterruptWatch()
    assert signal.getsignal(signal.SIGINT) == watch._handle
    watch.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_repeats_are_ignored_during_and_after_the_clean_up(sigint_handler):
    watch = InterruptWatch()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises as soon as the signal is handled
    assert watch.received
    os.kill(os.getpid(), signal.SIGINT)  # a repeat during the clean-up: nothing raised
    watch.release()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)  # torchrun's copy after the clean-up: ignored too
