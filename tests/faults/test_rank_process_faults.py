"""Faults around a rank's process: who may talk to the driver's control port, where a rank's
output goes (a full log disk, an over-long line, the stage it belongs to), and what a rank
leaves behind (processes its app started)."""

from __future__ import annotations

import socket
import sys
import time

import cloudpickle

import phalanx as px
from phalanx.executors.control import ControlServer
from phalanx.runtime import netio

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ranks need not import this module


def app_rank(env):
    return env.rank


# ---- 13: a connection to the control port that says nothing ------------------------------------
def test_a_silent_connection_to_the_control_port_does_not_hold_up_the_gangs_start(fault, monkeypatch, caplog):
    """Another user connects to the driver's control port and says nothing: every rank still
    registers (each handshake runs in a thread of its own, bounded by HANDSHAKE_S) and the gang
    starts while the silent connection is still open and unanswered."""
    fault.describe("a silent TCP connection to the driver's control port before the ranks connect")
    monkeypatch.setattr(netio, "HANDSHAKE_S", 120.0)  # the silent peer's slot outlasts the gang's start
    silent: list[socket.socket] = []
    init = ControlServer.__init__

    def connect_first(self, *args, **kwargs):
        init(self, *args, **kwargs)
        host, _, port = self.address.rpartition(":")
        silent.append(socket.create_connection((host, int(port))))

    monkeypatch.setattr(ControlServer, "__init__", connect_first)
    try:
        t0 = time.monotonic()
        with px.Gang(ranks=2, echo=False, start_timeout=60) as gang:
            took = time.monotonic() - t0
            assert gang.run(app_rank, timeout=60) == [0, 1]
            # the silent connection is still in its handshake: open, the challenge unanswered
            assert silent[0].recv(1024, socket.MSG_DONTWAIT), "the driver closed the silent connection"
        assert took < 30, took
    finally:
        for s in silent:
            s.close()
    fault.detected(0.0)
    fault.outcome(f"the gang started in {took:.1f} s while the silent connection stayed open")
    fault.data_lost("none")
