"""`launch.find_free_port`: rendezvous ports outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from megatron_ext import launch


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable():
    low, high = launch._listen_port_range()
    try:
        with open(launch._EPHEMERAL_RANGE_FILE) as f:
            eph_low, eph_high = (int(v) for v in f.read().split())
        assert high <= eph_low or low > eph_high
    except OSError:
        assert (low, high) == launch._LISTEN_PORTS
    ports = [launch.find_free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for port in ports:
        assert low <= port < high
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))
        sock.listen()


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(launch, "_listen_port_range", lambda: (taken, taken + 1))
        launch._drawn_ports.discard(taken)
        with pytest.raises(RuntimeError, match=f"{taken}-{taken} after 200 tries"):
            launch.find_free_port()
