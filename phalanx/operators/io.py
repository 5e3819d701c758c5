"""Reading files split across ranks, and writing one file per rank.

Rank 0 plans (lists files, reads Parquet footers or file sizes) and broadcasts the plan or
the error (``comm.on_root``), so every rank raises the same error for a bad path.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from .common import agree_schema

if TYPE_CHECKING:
    from ..runtime.env import BSPEnv
    from .dataframe import DataFrame


def expand_paths(path: str | os.PathLike | Sequence[str | os.PathLike], suffixes: tuple[str, ...]) -> list[str]:
    """A file, a directory (its files with ``suffixes``, recursively), a glob, or a list."""
    items: list[str | os.PathLike[Any]] = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    files: list[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            files += sorted(str(p) for p in Path(item).rglob("*") if p.suffix in suffixes and p.is_file())
        elif glob.has_magic(item):
            files += sorted(glob.glob(item, recursive=True))
        elif os.path.exists(item):
            files.append(item)
        else:
            raise FileNotFoundError(f"no such file or directory: {item!r}")
    if not files:
        raise FileNotFoundError(f"no files match {os.fspath(path) if isinstance(path, (str, os.PathLike)) else path!r}")
    return files


def _split_units(weights: Sequence[int], nparts: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of units with near-equal total weight per part."""
    cum = np.concatenate([[0], np.cumsum(weights)])
    total = cum[-1]
    cuts = [0] + [int(np.searchsorted(cum, total * i / nparts, side="left")) for i in range(1, nparts)] + [len(weights)]
    bounds = np.maximum.accumulate(cuts)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(nparts)]


SPLIT_OVER = 1.1  # a part over this times the mean rows, split by row groups: split by rows


def _split_rows(rows: Sequence[int], nparts: int) -> list[list[tuple[int, int, int]]]:
    """Each part's pieces (unit, first row, stop row), in order: whole units where a split by
    units leaves no part far over the mean (``SPLIT_OVER``), else near-equal ranges of rows,
    a unit cut where a range ends (TPC-H's customer file of one row group: every rank's share
    of it, not all of it on rank 0).  A part's rows stay one contiguous range of the whole."""
    ranges = _split_units(rows, nparts)
    total = int(sum(rows))
    if total == 0 or max(sum(rows[a:b]) for a, b in ranges) <= SPLIT_OVER * total / nparts:
        return [[(u, 0, int(rows[u])) for u in range(a, b)] for a, b in ranges]
    starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    parts = []
    for p in range(nparts):
        lo, hi = total * p // nparts, total * (p + 1) // nparts
        pieces = []
        for u in range(len(rows)):
            a, b = max(lo, int(starts[u])), min(hi, int(starts[u + 1]))
            if a < b:
                pieces.append((u, a - int(starts[u]), b - int(starts[u])))
        parts.append(pieces)
    return parts


# ---- Parquet ------------------------------------------------------------------------------
def _plan_parquet(path, columns, nparts):
    files = expand_paths(path, (".parquet", ".pq"))
    units, rows, schemas = [], [], []
    for f in files:
        try:
            meta = pq.ParquetFile(f).metadata
            schemas.append(meta.schema.to_arrow_schema())
        except Exception as exc:
            raise ValueError(f"read_parquet: cannot read {f!r}: {exc}") from None
        for rg in range(meta.num_row_groups):
            units.append((f, rg, meta.row_group(rg).num_rows))
            rows.append(meta.row_group(rg).num_rows)
    try:
        schema = pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise TypeError(f"read_parquet: files under {path!r} have incompatible schemas: {exc}") from None
    if columns is not None:
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise KeyError(f"read_parquet: unknown column(s) {missing}; the files have {schema.names}")
        schema = pa.schema([schema.field(c) for c in columns])
    return units, _split_rows(rows, nparts), schema


def read_parquet(path, env: BSPEnv, columns: Sequence[str] | None = None) -> DataFrame:
    """Parquet files (a path, directory, glob or list) split across ranks by row groups."""
    from .dataframe import DataFrame

    cols = list(columns) if columns is not None else None
    units, parts, schema = env.comm.on_root(_plan_parquet, path, cols, env.world_size)
    pieces = [(units[u][0], units[u][1], lo, hi, lo == 0 and hi == units[u][2]) for u, lo, hi in parts[env.rank]]
    # nothing is read yet: the frame's pipeline says which columns and rows it needs
    return DataFrame.lazy(ParquetScan(path, pieces, schema), env)


class ParquetScan:
    """This rank's row groups of a Parquet read (a row group several ranks share: its rows in
    this rank's share), read when the frame's rows are needed: only the columns the plan uses,
    and with the filters pushed into it (whole row groups whose statistics rule a filter out
    are skipped, the rest filtered as they are decoded; a share of a row group filtered once
    cut)."""

    pushes_filters = True

    def __init__(self, path: Any, pieces: list[tuple[str, int, int, int, bool]], schema: pa.Schema):
        self.path, self.pieces, self.schema = path, pieces, schema

    def read(self, columns: list[str], filters: Sequence[Any]) -> pa.Table:
        schema = pa.schema([self.schema.field(c) for c in columns])
        tables = []
        for f, groups, share in self._segments():
            if share is None:
                tables.append(_read_row_groups(f, groups, columns, self.schema, filters))
            else:
                tables.append(_read_share(f, groups[0], *share, columns, self.schema, filters))
        tables = [t.select(columns).cast(schema) if not t.schema.equals(schema) else t for t in tables]
        return pa.concat_tables(tables) if tables else schema.empty_table()

    def _segments(self) -> list[tuple[str, list[int], tuple[int, int] | None]]:
        """The pieces in order as reads: (file, whole row groups in a row, None) or (file, [a
        row group], (first row, stop row) of this rank's share of it)."""
        out: list[tuple[str, list[int], tuple[int, int] | None]] = []
        for f, rg, lo, hi, whole in self.pieces:
            if whole and out and out[-1][0] == f and out[-1][2] is None:
                out[-1][1].append(rg)
            else:
                out.append((f, [rg], None if whole else (lo, hi)))
        return out

    def describe(self, columns: list[str], filters: Sequence[Any]) -> str:
        files = len(dict.fromkeys(f for f, *_ in self.pieces))
        shares = sum(not whole for *_, whole in self.pieces)
        groups = f"{len(self.pieces)} row groups" + (f" ({shares} of them in part)" if shares else "")
        where = f", filter {' and '.join(str(f) for f in filters)}" if filters else ""
        return (
            f"Scan parquet {os.fspath(self.path) if isinstance(self.path, (str, os.PathLike)) else self.path!r}: "
            f"{groups} of {files} files on this rank, columns {columns}{where}"
        )


def _read_share(
    f: str, rg: int, lo: int, hi: int, columns: list[str], schema: pa.Schema, filters: Sequence[Any]
) -> pa.Table:
    """Rows [lo, hi) of row group ``rg`` of ``f``, filtered: the whole row group is decoded
    (Parquet's unit), with the columns the filters read, then cut."""
    from .plan import references

    refs = set().union(*(references(e, schema) for e in filters)) if filters else set()
    wanted = [c for c in schema.names if c in set(columns) | refs]
    table = _read_row_groups(f, [rg], wanted).slice(lo, hi - lo)
    for expr in filters:
        table = table.filter(expr)
    return table


def _read_row_groups(
    f: str,
    row_groups: list[int],
    columns: list[str] | None,
    schema: pa.Schema | None = None,
    filters: Sequence[Any] = (),
) -> pa.Table:
    """``row_groups`` of the file ``f``; a damaged file's error names it, and the row group
    and column that fail to decode where one does (pyarrow's says only, e.g., "Corrupt snappy
    compressed data")."""
    try:
        pf = pq.ParquetFile(f)
    except Exception as exc:
        raise ValueError(f"read_parquet: cannot read {f!r}: {exc}") from None
    try:
        if not filters:
            return pf.read_row_groups(row_groups, columns=columns)
        import pyarrow.dataset as ds
        import pyarrow.fs as pafs

        # the file's own types for the filter (a unified int64 column may be int32 here)
        fragment = ds.ParquetFileFormat().make_fragment(f, pafs.LocalFileSystem(), row_groups=row_groups)
        return fragment.to_table(schema=pf.schema_arrow, columns=columns, filter=_all_of(filters))
    except Exception as exc:
        where = _failing_column_chunk(pf, row_groups, columns) or f"row groups {row_groups}"
        raise ValueError(f"read_parquet: cannot read {f!r}, {where}: {exc}") from None


def _all_of(filters: Sequence[Any]) -> Any:
    expr = filters[0]
    for f in filters[1:]:
        expr = expr & f
    return expr


def _failing_column_chunk(pf: pq.ParquetFile, row_groups: list[int], columns: list[str] | None) -> str | None:
    """The first row group and column of ``pf`` that fail to read alone (after a read of them
    all failed), as ``"row group 3, column 'x'"``; None when each reads alone."""
    names = columns if columns is not None else pf.schema_arrow.names
    for rg in row_groups:
        for name in names:
            try:
                pf.read_row_group(rg, columns=[name])
            except Exception:
                return f"row group {rg}, column {name!r}"
    return None


# ---- CSV ----------------------------------------------------------------------------------
def _plan_csv(path, nparts):
    files = expand_paths(path, (".csv", ".tsv", ".txt"))
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    # Byte ranges of ~total/nparts; a file is cut only at line starts when read.
    chunk = max(1, -(-total // nparts))
    pieces = []
    for f, size in zip(files, sizes):
        for off in range(0, max(size, 1), chunk):
            pieces.append((f, off, min(size, off + chunk), size))
    weights = [stop - start for _, start, stop, _ in pieces]
    return pieces, _split_units(weights, nparts)


def _read_csv_range(f: str, start: int, stop: int, size: int, options: dict) -> pa.Table:
    """Rows that *start* within [start, stop): the header comes from the file's first line."""
    with open(f, "rb") as fh:
        header = fh.readline()
        begin = max(start, len(header))
        if begin > len(header):
            fh.seek(begin - 1)
            if fh.read(1) != b"\n":
                fh.readline()  # finish the line that began before our range
            begin = fh.tell()
        fh.seek(begin)
        body = fh.read(max(0, stop - begin))
        if stop < size and body and not body.endswith(b"\n"):
            body += fh.readline()  # the last line that starts in range
    data = header + body
    read = pacsv.ReadOptions(**options.get("read_options", {}))
    parse = pacsv.ParseOptions(**options.get("parse_options", {}))
    convert = pacsv.ConvertOptions(**options.get("convert_options", {}))
    try:
        return pacsv.read_csv(pa.BufferReader(data), read_options=read, parse_options=parse, convert_options=convert)
    except pa.ArrowException as exc:  # ArrowInvalid (a parse error) and the rest: name the file
        raise ValueError(f"read_csv: {f!r} (bytes {start}-{stop}): {exc}") from None


def read_csv(
    path, env: BSPEnv, column_types: dict[str, pa.DataType] | None = None, delimiter: str = ",", **options: Any
) -> DataFrame:
    """CSV files split across ranks by byte ranges at line boundaries (quoted fields must not
    contain newlines when a file is split); ranks agree on column types afterwards."""
    from .dataframe import DataFrame

    opts = dict(options)
    opts.setdefault("parse_options", {})["delimiter"] = delimiter
    if column_types:
        opts.setdefault("convert_options", {})["column_types"] = column_types
    pieces, ranges = env.comm.on_root(_plan_csv, path, env.world_size)
    start, stop = ranges[env.rank]
    tables = [_read_csv_range(f, a, b, size, opts) for f, a, b, size in pieces[start:stop]]
    if tables:
        table = pa.concat_tables(tables, promote_options="permissive")
    else:  # no bytes for this rank: take the column names (types agree below)
        f = pieces[0][0]
        table = _read_csv_range(f, 0, 0, os.path.getsize(f), opts).slice(0, 0)
    return DataFrame(agree_schema(env.comm, table, f"read_csv({path!r})"), env)


# ---- output -------------------------------------------------------------------------------
def write_parquet(df: DataFrame, directory: str | os.PathLike, **options: Any) -> str:
    env = df.env
    out = Path(directory)
    if env.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("part-*.parquet"):
            old.unlink()  # a previous, maybe wider, write must not mix with this one
    env.comm.barrier()
    pq.write_table(df.to_arrow(), out / f"part-{env.rank:05d}.parquet", **options)
    env.comm.barrier()
    return str(out)
