"""Addresses as executors reason about them: can ranks elsewhere reach this one?  And the
driver's beacon, whose end tells a pilot's holder that the driver is gone."""

from __future__ import annotations

import ipaddress
import socket
import threading


def is_loopback(host: str | None) -> bool:
    """An address (or ``localhost``) only this machine reaches."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Beacon:
    """A listener whose connections this process holds open until it ends: a pilot's holder
    (a SLURM pilot's ``_HOLDER``, a RADICAL-Pilot watcher) connects and ends the pilot on end
    of file — the driver is gone, even when it was SIGKILLed."""

    def __init__(self, host: str, name: str = "phalanx-pilot-beacon"):
        self.sock = socket.create_server((host, 0))
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:  # closed
                return

    def close(self) -> None:
        for s in [self.sock, *self.conns]:
            s.close()
