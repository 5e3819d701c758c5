"""Ends a local pilot when its driver dies (run by the pilot's bootstrap, in its sandbox).

RP's agent does not notice that its client is gone (RP 1.103 keeps no client heartbeat in the
agent): a driver killed without a word would leave the pilot — RP's agent, its dozen
components and the tasks on it — until its walltime.  phalanx's RP session holds a listener
(``network.Beacon``) and puts ``python watch.py HOST PORT &`` in the resource's
``pre_bootstrap_0``: this process connects to it and, when the connection ends (the driver
exited or was killed), asks the agent to cancel the pilot through its command port (as
``radical-pilot-control`` does) and ends every process working in the pilot's sandbox, its
working directory.  The normal end of a pilot (``close_run``) ends this process with the rest.

Standard library only: it runs with the pilot's Python before the agent's environment exists.
"""

import json
import os
import signal
import socket
import sys
import time


def _in_box(box):
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            cwd = os.readlink("/proc/%s/cwd" % name)
        except OSError:
            continue
        if cwd == box or cwd.startswith(box + "/"):
            found.append(int(name))
    return found


def _kill(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def main(host, port):
    try:
        conn = socket.create_connection((host, int(port)), timeout=30)
    except OSError:
        return 0  # no driver to watch (it is gone already, or unreachable): RP's walltime holds
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    box = os.path.realpath(os.getcwd())
    try:  # the agent's own way out first
        with open(os.path.join(box, "agent_0.ports.json")) as f:
            info = json.load(f)
        with socket.create_connection((info["command_hostip"], int(info["command_port"])), timeout=5) as s:
            s.sendall(json.dumps({"cmd": "cancel_pilots", "arg": {"uids": [os.path.basename(box)]}}).encode())
            s.recv(16)
        deadline = time.monotonic() + 5
        while _in_box(box) and time.monotonic() < deadline:
            time.sleep(0.2)
    except (OSError, ValueError, KeyError):
        pass
    _kill(_in_box(box), signal.SIGTERM)  # tasks the agent leaves running, or an agent that hangs
    time.sleep(2)
    _kill(_in_box(box), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
