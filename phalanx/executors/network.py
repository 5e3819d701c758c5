"""Addresses as executors reason about them: can ranks elsewhere reach this one?"""

from __future__ import annotations

import ipaddress


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
