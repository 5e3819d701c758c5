"""A third-party executor in one module, as docs/executors.md shows: every rank is started
through a shell (``sh -c 'exec "$@"'``), e.g. where a site needs a login environment first.

Registered by the tests as an entry point (group ``phalanx.executors``) or a registry line.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import Field

from phalanx.errors import PhalanxError
from phalanx.executors.base import Capabilities, Echo, Executor, ExecutorConfig
from phalanx.executors.local import LocalLauncher


class ShellConfig(ExecutorConfig):
    """The ``shell:`` section of a site file."""

    shell: str = Field("/bin/sh", description="the shell every rank starts under")
    rank_slots: int = Field(4, ge=1, description="ranks that may run at once")
    max_ranks: int | None = Field(None, ge=1, description="refuse gangs larger than this")

    def slots(self) -> int | None:
        return self.rank_slots


class ShellLauncher(LocalLauncher):
    name = "shell"

    def __init__(self, shell: str, echo: Echo = False):
        super().__init__(echo=echo, pin=False)
        self.shell = shell

    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None:
        super().launch([self.shell, "-c", 'exec "$@"', "phalanx-rank", *argv], rank_env, log_dir)


class ShellExecutor(Executor):
    name = "shell"
    config_model = ShellConfig
    capabilities = Capabilities(runs_commands=True)

    def check(self, ranks: int, config: ExecutorConfig) -> None:
        if config.max_ranks and ranks > config.max_ranks:
            raise PhalanxError(
                f"site {self.site!r} (shell): a gang of {ranks} ranks is over max_ranks {config.max_ranks}"
            )

    def launcher(
        self, ranks: int, *, slots: Sequence[int] = (), config: ExecutorConfig | None = None, echo: Echo = False
    ) -> ShellLauncher:
        launcher = ShellLauncher((config or self.config).shell, echo=echo)
        launcher.allocation_hook = self.hook
        return launcher
