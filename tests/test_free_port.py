"""free_port: a local job's rendezvous port stays free between the pick and the job's TCPStore binding it."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from afm_core.utils import ports as port_picker
from afm_core.utils.ports import LOCAL_PORTS, free_port


def plain_bind_fails(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def test_the_port_is_outside_the_ephemeral_range_held_from_other_pickers_and_a_tcpstore_binds_it():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20  # each held in TIME_WAIT: a later call draws another
    low, high = LOCAL_PORTS
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(low <= p <= min(high, ephemeral_low - 1) for p in ports)
    assert all(plain_bind_fails(p) for p in ports)  # what a concurrent free_port's probe sees
    for port, use_libuv in zip(ports, (True, False)):  # what init_process_group's env:// rendezvous does on rank 0
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=10), use_libuv=use_libuv)
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store


def test_where_the_ephemeral_range_starts_low_the_kernel_picks_and_the_port_is_still_held(monkeypatch):
    monkeypatch.setattr(port_picker, "_ephemeral_low", lambda: LOCAL_PORTS[0])
    port = free_port()
    assert port > 0 and plain_bind_fails(port)


def test_no_free_port_is_an_error_naming_the_range(monkeypatch):
    monkeypatch.setattr(port_picker, "LOCAL_PORTS", (27777, 27777))
    with socket.socket() as busy:
        try:
            busy.bind(("127.0.0.1", 27777))
        except OSError:
            pytest.skip("port 27777 is taken on this machine")
        busy.listen(1)
        with pytest.raises(OSError, match="27777-27777"):
            free_port()
