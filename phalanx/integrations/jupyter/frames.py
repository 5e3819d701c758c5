"""A ``px.DataFrame`` that lives on the ranks, seen from the notebook's driver.

``%%px`` cells keep their names on the ranks; a frame among them (each rank holds one partition)
can be looked at from the driver without moving it: ``RemoteFrame(gang, "df")`` — or
``%%px --out df``, or ``phalanx.integrations.jupyter.frame("df")`` — gives ``head(n)`` and
``collect(limit=...)`` as pandas (rows in rank order, as ``DataFrame.collect`` gives them on a
rank), ``num_rows``, ``partition_sizes()`` and ``schema``; in a notebook it shows as a preview.
Each call asks every rank for at most ``limit`` rows of its partition (no collective: a frame
that exists on only some ranks is an error, not a hang).
"""

from __future__ import annotations

from typing import Any

from ...errors import GangError
from . import html as H
from . import settings
from .hooks import view_options

FRAME_APP = "phalanx.integrations.jupyter.ranks:frame_part"


class RemoteFrame:
    def __init__(self, gang: Any, name: str):
        if gang is None:
            raise GangError("no gang: start one with %px_gang N, or pass gang=")
        self._gang, self.name, self.gang_id = gang, name, gang.gang_id
        self.partition_sizes()  # the frame exists on every rank, now

    def _parts(self, limit: int | None) -> list[dict]:
        gang = self._gang
        if not gang.running or gang.gang_id != self.gang_id:
            raise GangError(
                f"frame {self.name!r} lived on gang {self.gang_id}, which was stopped: its ranks "
                "and their names are gone"
            )
        with view_options(quiet=True):
            parts = gang.run(FRAME_APP, self.name, limit)
        errors = [p["error"] for p in parts if "error" in p]
        if errors:
            raise NameError(f"frame {self.name!r}: {errors[0]}")
        return parts

    def to_arrow(self, limit: int | None = None):
        """The first ``limit`` rows (None: all) as a ``pyarrow.Table``, in rank order."""
        import pyarrow as pa

        tables = [p["table"] for p in self._parts(limit)]
        table = pa.concat_tables(tables, promote_options="default") if tables else None
        return table if limit is None or table is None else table.slice(0, limit)

    def head(self, n: int = 5):
        """The first ``n`` rows as pandas."""
        return self.to_arrow(n).to_pandas()

    def collect(self, limit: int | None = None):
        """The whole frame (or its first ``limit`` rows) as pandas: mind the driver's memory."""
        return self.to_arrow(limit).to_pandas()

    def partition_sizes(self) -> list[int]:
        return [p["rows"] for p in self._parts(0)]

    @property
    def num_rows(self) -> int:
        return sum(self.partition_sizes())

    @property
    def schema(self):
        return self._parts(0)[0]["table"].schema

    @property
    def columns(self) -> list[str]:
        return self.schema.names

    def _preview(self) -> tuple[int, list[int], Any]:
        parts = self._parts(settings.preview_rows)
        sizes = [p["rows"] for p in parts]
        import pyarrow as pa

        head = pa.concat_tables([p["table"] for p in parts]).slice(0, settings.preview_rows).to_pandas()
        return sum(sizes), sizes, head

    def _repr_html_(self) -> str:
        rows, sizes, head = self._preview()
        return H.frame_html(self.name, rows, sizes, head, None, settings.preview_rows)

    def __repr__(self) -> str:
        try:
            rows, sizes, head = self._preview()
        except Exception as exc:
            return f"<phalanx RemoteFrame {self.name!r} on gang {self.gang_id}: {exc}>"
        return H.frame_text(self.name, rows, sizes, head, None, settings.preview_rows)


def preview(name: str, parts: list[dict], rows_shown: int) -> tuple[str, str]:
    """HTML and text of a frame from the first rows each rank sent (``CellReply.frame``)."""
    import pyarrow as pa

    sizes = [p["rows"] for p in parts]
    head = pa.concat_tables([p["head"] for p in parts], promote_options="default").slice(0, rows_shown).to_pandas()
    by = next((p["partitioned_by"] for p in parts if p.get("partitioned_by")), None)
    return (
        H.frame_html(name, sum(sizes), sizes, head, by, rows_shown),
        H.frame_text(name, sum(sizes), sizes, head, by, rows_shown),
    )
