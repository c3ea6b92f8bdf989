"""A free TCP port for a local rendezvous or a local server, kept from other takers until it is bound."""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

LOCAL_PORTS = (25000, 32767)  # above slurm_rendezvous_port's 15000-24999, below Linux's default ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` for a local job's rendezvous (or a local server), free now and kept from other takers
    until the job binds it.

    Picking a free port and binding it later races: in between, the port can go to an outgoing connection or to
    another picker (seen as ``TCPStore`` failing with EADDRINUSE on a busy machine). Two measures close it:

    - The port is drawn from :data:`LOCAL_PORTS`, below the kernel's ephemeral range
      (``/proc/sys/net/ipv4/ip_local_port_range``, Linux default 32768-60999), so no outgoing connection and no
      ``bind(port=0)`` is handed it, however long the job takes to start (the reason for
      :func:`afm_core.launch.distributed.slurm_rendezvous_port`'s range too). Where the ephemeral range starts lower, the kernel picks.
    - It is left in TIME_WAIT (a connection to it whose accepted side closes first), Yelp's
      ``ephemeral_port_reserve.reserve``: for the next 60 s a bind without ``SO_REUSEADDR`` -- this function's own
      probe, so a concurrent call -- fails on it, while ``TCPStore``, uvicorn and aiohttp, which set
      ``SO_REUSEADDR``, bind it.

    Raises:
        OSError: no free port in 200 draws.
    """
    low, high = LOCAL_PORTS
    high = min(high, _ephemeral_low() - 1)
    draws = random.SystemRandom()
    for _ in range(200):
        port = draws.randint(low, high) if low <= high else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            try:
                listener.bind((host, port))  # no SO_REUSEADDR yet: fails on a port in use or in TIME_WAIT
            except OSError as err:
                if err.errno == errno.EADDRINUSE and port:
                    continue
                raise
            # set before the connection so the TIME_WAIT socket it leaves lets SO_REUSEADDR binds through
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.listen(1)
            port = listener.getsockname()[1]
            with socket.create_connection((host, port)):
                accepted, _ = listener.accept()
                accepted.close()  # the server side closes first: it is the one left in TIME_WAIT
            return port
    raise OSError(errno.EADDRINUSE, f"no free TCP port on {host} in {low}-{high} after 200 draws")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
