"""The fault suite (marker ``faults``): each test injects one fault and states what phalanx did.

A test asks for the ``fault`` fixture and fills in what the reliability table shows::

    def test_kill_rank(fault):
        fault.describe("kill a rank mid-shuffle", backend="local")
        ...                                  # inject, measure
        fault.detected(seconds)              # time from the fault to phalanx noticing it
        fault.outcome("gang stopped, retry gave the right answer")
        fault.data_lost("none")              # what the user lost (the suite requires none)

Rows are appended (one JSON line per test, with whether it passed) to the file named by
``PHALANX_FAULT_RESULTS`` when it is set; ``scripts/reliability_table.py`` runs the suite with
it and regenerates the table in docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import pytest


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.faults)


@dataclass
class FaultRecord:
    test: str
    fault: str = ""
    backend: str = "local"
    result: str = ""
    detect_s: float | None = None
    lost: str = ""
    passed: bool = False
    started: float = field(default_factory=time.time)

    def describe(self, fault: str, backend: str = "local") -> None:
        self.fault, self.backend = fault, backend

    def detected(self, seconds: float) -> None:
        self.detect_s = round(seconds, 2)

    def outcome(self, text: str) -> None:
        self.result = text

    def data_lost(self, text: str) -> None:
        self.lost = text


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.fault_call_passed = report.passed


@pytest.fixture
def fault(request):
    record = FaultRecord(request.node.nodeid)
    yield record
    record.passed = bool(getattr(request.node, "fault_call_passed", False))
    path = os.environ.get("PHALANX_FAULT_RESULTS")
    if path and record.fault:
        with open(path, "a") as f:
            f.write(json.dumps(asdict(record)) + "\n")
