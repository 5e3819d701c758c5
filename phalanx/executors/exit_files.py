"""Per-rank exit-code files: how a launcher learns each rank's exit code where its resource
manager reports one code for the whole gang (srun: the largest; an RP task: one).

Each rank runs under a small shell wrapper that ends with ``record(...)``: it writes the rank's
``$rc`` to ``DIR/rank-R.exit`` through a temporary file and a rename, so a reader sees a whole
code or none.  ``read`` gives it back as a Popen-style return code.
"""

from __future__ import annotations

from pathlib import Path


def record(directory: str, rank: str) -> str:
    """Shell that writes ``$rc`` to ``directory/rank-<rank>.exit`` (both are shell words:
    ``$d``, ``$SLURM_PROCID``...)."""
    return f'f="{directory}/rank-{rank}.exit"; echo $rc > "$f.tmp" && mv -f "$f.tmp" "$f"'


def path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank}.exit"


def shell_code(rc: int) -> int:
    """A shell's ``$?`` as Popen's return code: 128+N means killed by signal N (-N)."""
    return -(rc - 128) if 128 < rc < 128 + 65 else rc


def read(directory: Path, rank: int) -> int | None:
    """The exit code rank ``rank`` recorded in ``directory`` (-N: killed by signal N); None
    while it has recorded none."""
    try:
        text = path(directory, rank).read_text().strip()
    except OSError:
        return None
    return shell_code(int(text)) if text.lstrip("-").isdigit() else None


def clear(directory: Path) -> None:
    """Remove the exit files of an earlier gang in ``directory`` (a gang restarted there)."""
    for old in Path(directory).glob("rank-*.exit*"):
        old.unlink(missing_ok=True)


__all__ = ["clear", "path", "read", "record", "shell_code"]
