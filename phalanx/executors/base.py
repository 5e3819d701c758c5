"""The executor interface: start, watch and stop the processes of one gang.

An executor only launches processes; the control plane (connecting ranks, sending apps,
fail-fast) is shared by every executor in ``control`` and ``phalanx.gang``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Sequence


class Launcher(ABC):
    """Starts ``world_size`` copies of ``argv``, rank r with ``rank_env[r]`` added to its env."""

    name = "abstract"

    @abstractmethod
    def launch(self, argv: Sequence[str], rank_env: list[dict[str, str]], log_dir: Path) -> None: ...

    @abstractmethod
    def exitcodes(self) -> list[int | None]:
        """Per rank: None while running, else the exit code (negative: killed by that signal)."""

    @abstractmethod
    def kill(self, grace_s: float = 2.0) -> None:
        """Stop every rank: SIGTERM, then SIGKILL after ``grace_s``; reap them."""

    def placement(self, world_size: int) -> list[dict[str, str]]:
        """Extra per-rank environment for placement (CPU affinity, threads)."""
        return [{} for _ in range(world_size)]


def shared_env(rank_env: list[dict[str, str]], per_rank: Sequence[str], launcher: str) -> dict[str, str]:
    """The one environment a launcher that starts all ranks at once (mpirun, srun) gives them:
    ``rank_env`` without the ``per_rank`` keys, which must then be the same for every rank."""
    common = {k: v for k, v in rank_env[0].items() if k not in per_rank}
    for r, env in enumerate(rank_env):
        rest = {k: v for k, v in env.items() if k not in per_rank}
        if rest != common:
            diff = sorted(set(rest.items()) ^ set(common.items()))
            raise ValueError(f"{launcher} gives every rank the same environment; rank {r} differs in {diff}")
    return common
