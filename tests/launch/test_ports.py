"""The launchers' ports (arbor.launch.process.free_port): drawn outside the kernel's ephemeral range, which any
outgoing connection may take as its source port between the draw and the server's bind."""

from __future__ import annotations

import socket

from arbor.launch import process


def test_free_ports_are_drawn_below_the_ephemeral_range():
    low, _ = process.ephemeral_range()
    ports = {process.free_port() for _ in range(20)}
    assert all(process.LOWEST_PORT <= p < low for p in ports) and len(ports) > 1


def test_a_held_port_is_skipped_and_no_room_falls_back_to_the_kernels_pick(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, *range(20000, 20100)])

        class Draw:
            def randrange(self, start: int, stop: int) -> int:
                return next(draws)

        monkeypatch.setattr(process.random, "SystemRandom", Draw)
        monkeypatch.setattr(process, "LOWEST_PORT", 1024)
        monkeypatch.setattr(process, "ephemeral_range", lambda: (65535, 65535))
        assert 20000 <= process.free_port() < 20100  # the held one is skipped
    monkeypatch.setattr(process, "ephemeral_range", lambda: (1500, 65535))  # no room below the range
    assert 0 < process.free_port() <= 65535
