"""A real Jupyter kernel for the notebook tests (tests/test_jupyter.py, bench/jupyter.py).

The kernel is this venv's Python running ipykernel, from a kernelspec written to a temporary
directory (never the user's Jupyter directories).  Its environment carries a tag of its own, so
every process it starts — rank processes included, whatever gang they belong to — can be found
in /proc, before and after the kernel is gone; its run database and logs live in the temporary
directory too.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

HERE = Path(__file__).resolve().parent
TAG = "PHALANX_TEST_KERNEL_TAG"
SPEC = "phalanx-test"


def kernelspec(directory: Path, tag: str, extra_env: dict[str, str] | None = None) -> KernelSpecManager:
    """A kernelspec ``phalanx-test`` for this interpreter under ``directory/kernels``."""
    spec_dir = directory / "kernels" / SPEC
    spec_dir.mkdir(parents=True, exist_ok=True)
    env = {
        TAG: tag,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PHALANX_STATE": str(directory / "state"),
        "PHALANX_LOG_DIR": str(directory / "logs"),
        **(extra_env or {}),
    }
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "phalanx test (this venv)",
                "language": "python",
                "env": env,
            }
        )
    )
    return KernelSpecManager(kernel_dirs=[str(directory / "kernels")])


def tagged_processes(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries ``TAG=tag``."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # gone, or not ours to read
            continue
        found.append(int(entry))
    return found


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has ``name=value`` (a gang's PHALANX_GANG_ID)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat") as s:
                            if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                                found.append(int(entry))
            except OSError:
                pass
    return found


def until(condition, what: str, within: float = 60.0, every: float = 0.05):
    """Wait for ``condition()`` to be true (returns its value); fails after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:g} s")
        time.sleep(every)


@dataclass
class Result:
    reply: dict
    msgs: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    def of(self, *types: str) -> list[dict]:
        return [m for m in self.msgs if m["msg_type"] in types]

    def data(self, mime: str = "text/plain", *types: str) -> list[str]:
        """Every ``mime`` payload of display/update/result messages (in order)."""
        types = types or ("display_data", "update_display_data", "execute_result")
        return [m["content"]["data"][mime] for m in self.of(*types) if mime in m["content"].get("data", {})]

    def stream(self, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for m in self.of("stream") if m["content"]["name"] == name)

    @property
    def error(self) -> dict | None:
        errors = self.of("error")
        return errors[-1]["content"] if errors else None

    def last(self, mime: str = "text/plain") -> str:
        """The last thing shown of ``mime`` (the final picture of a live view, the cell's result)."""
        got = self.data(mime)
        return got[-1] if got else ""


class Kernel:
    """A started kernel and its client; ``execute`` runs a cell and returns everything it sent."""

    def __init__(self, directory: Path, cwd: Path | None = None, extra_env: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.tag = uuid.uuid4().hex
        self.km = KernelManager(kernel_name=SPEC, kernel_spec_manager=kernelspec(self.directory, self.tag, extra_env))
        self.km.start_kernel(cwd=str(cwd or HERE))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def execute(self, code: str, timeout: float = 300.0, hook=None, ok: bool = True) -> Result:
        """Run ``code``; ``hook(msg)`` sees each output message as it comes (while the cell runs).
        ``ok``: fail unless the cell succeeded."""
        msgs: list = []

        def collect(msg):
            msgs.append(msg)
            if hook is not None:
                hook(msg)

        t0 = time.perf_counter()
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=collect, allow_stdin=False)
        result = Result(reply, msgs, time.perf_counter() - t0)
        if ok and result.status != "ok":
            err = result.error or {}
            raise AssertionError(
                f"cell failed: {err.get('ename')}: {err.get('evalue')}\n"
                + "\n".join(err.get("traceback", []))
                + f"\n--- cell:\n{code}"
            )
        return result

    def value(self, expr: str):
        """``expr`` evaluated in the kernel, brought back as JSON."""
        res = self.execute(f"import json as _json; print(_json.dumps({expr}))")
        return json.loads(res.stream().strip().splitlines()[-1])

    def processes(self) -> list[int]:
        return tagged_processes(self.tag)

    def shutdown(self, now: bool = False) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=now)
