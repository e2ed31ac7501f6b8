"""The ports tests and `tandem up` hand to their services (tandem/cli/ports.py): outside the kernel's
ephemeral range, free when handed out, never handed out twice in a process."""

from __future__ import annotations

import socket

import pytest

from tandem.cli.ports import PortPool, ephemeral_range, free_port, quiet_ports


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(path) == (40000, 50000)
    assert ephemeral_range(tmp_path / "absent") == (32768, 60999)


def test_quiet_ports_lie_below_the_ephemeral_range_or_above_it_when_below_is_smaller():
    assert quiet_ports((32768, 60999)) == range(20000, 32768)
    assert quiet_ports((1024, 60999)) == range(61000, 65536)
    assert quiet_ports((1024, 65535)) == range(65536, 65536)


def test_no_quiet_port_is_an_error_that_says_what_to_change():
    with pytest.raises(RuntimeError, match="outside the ephemeral range"):
        PortPool(range(65536, 65536))


def four_free_ports() -> range:
    """Four consecutive ports free now."""
    while True:
        first = free_port()
        ports = range(first, first + 4)
        if all(bindable(port) for port in ports):
            return ports


def bindable(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
        return True
    except OSError:
        return False


def test_the_pool_hands_out_ports_in_order_from_its_start_skipping_a_taken_one():
    ports = four_free_ports()
    with socket.create_server(("127.0.0.1", ports[2])):  # taken: listened on
        pool = PortPool(ports, start=1)
        assert [pool.take(), pool.take()] == [ports[1], ports[3]]
    assert pool.take() == ports[0]  # wrapped round; ports[2] was passed over for good
    with pytest.raises(RuntimeError, match="handed out or taken"):
        pool.take()


def test_free_ports_are_outside_the_ephemeral_range_bindable_and_distinct():
    first, last = ephemeral_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert not [port for port in ports if first <= port <= last]
    for port in ports[:5]:
        with socket.create_server(("127.0.0.1", port)):
            pass
