"""The test servers' port helper."""

import socket

from paddle_step.testing.server_process import free_port


def test_free_ports_are_bindable_distinct_and_below_the_ranges_others_draw_from():
    """Each may be bound; none repeats; none is one the kernel or Paddle's launcher hands
    out on its own (a port from those could be taken before the server binds it)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        ephemeral_start = int(ports.read().split()[0])
    drawn = [free_port() for _ in range(200)]
    assert len(set(drawn)) == len(drawn)
    assert all(1024 <= port < min(ephemeral_start, 35100) for port in drawn), drawn
    with socket.socket() as server:
        server.bind(("127.0.0.1", drawn[-1]))
