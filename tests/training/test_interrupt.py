"""`training.interrupt.SignalWatch`: as the Ctrl-C watch, the first SIGINT interrupts, repeats
are ignored, and after an interrupt they stay ignored (torchrun's forwarded copy may land after
the clean-up); as the --exit-signal-handler watch, it only notes the signal and puts the previous
handler back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_ext.training.interrupt import SignalWatch


@pytest.fixture
def handlers():
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGUSR1)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_release_restores_the_previous_handler_when_no_signal_came(handlers):
    watch = SignalWatch()
    assert signal.getsignal(signal.SIGINT) == watch._handle
    watch.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_repeats_are_ignored_during_and_after_the_clean_up(handlers):
    watch = SignalWatch()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the handler raises as soon as the signal is handled
    assert watch.received
    os.kill(os.getpid(), signal.SIGINT)  # a repeat during the clean-up: nothing raised
    watch.release()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)  # torchrun's copy after the clean-up: ignored too


def test_an_exit_signal_is_noted_and_its_handler_put_back(handlers):
    previous = signal.getsignal(signal.SIGUSR1)
    watch = SignalWatch((signal.SIGUSR1,), interrupt=False)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    assert watch.received
    watch.release()
    assert signal.getsignal(signal.SIGUSR1) == previous
