"""The statistical aggregations of ``groupby(...).agg`` and ``agg``: std, var, corr, cov, any,
all, median, quantile and nunique.

Decomposable ones are partial columns plus a combine step, like sum and mean
(``phalanx.operators.groupby``): var and std from each partial's count, mean and sum of squared
deviations (M2), merged by Chan et al.'s parallel formula — the group's mean first (a window
over the partial rows), then ``M2 = Σ M2ᵢ + Σ nᵢ (meanᵢ - mean)²`` — never a sum of squares
minus a squared sum, which cancels catastrophically when the mean is large against the spread;
cov and corr the same with a co-moment; any and all with ``bool_or`` / ``bool_and``.  Over raw
rows (one rank, co-partitioned frames, a raw shuffle) the final step is DuckDB's own aggregate.

Holistic ones need every row of a group in one place: a group-by with any of them shuffles raw
rows by key (one shuffle serves every aggregation of the call) and finishes with DuckDB's
``quantile_cont`` / ``COUNT(DISTINCT)``.  Without keys (``df.agg``) no rank may receive every
row: ``nunique`` exchanges each rank's distinct values hashed by value (one exchange for all
such columns) and sums the distinct counts of the ranks; ``median``/``quantile`` find the exact
order statistics by a radix selection on order-preserving codes (``select_codes``): four rounds
of one allreduce of 2¹⁶-bucket histograms each, no rows moved.

Nulls are skipped (pandas' ``skipna``); NaN is a value, as in DuckDB and phalanx's sum/mean: it
makes std/var/corr/cov NaN, sorts above every number for median/quantile and is one distinct
value for nunique (-0.0 and 0.0 are one value).  any/all of no values are False/True (pandas).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..runtime.comm.base import Communicator
from . import kernels
from .exchange import concat, exchange_tables
from .plan import note, rows
from .sort import _sort_codes

if TYPE_CHECKING:
    from .groupby import Agg

DECOMPOSABLE = ("std", "var", "corr", "cov", "any", "all")
HOLISTIC = ("median", "quantile", "nunique")
FUNCS = DECOMPOSABLE + HOLISTIC
NUMERIC = ("std", "var", "median", "quantile", "corr", "cov")  # integers, floats, decimals, bools
PAIRS = ("corr", "cov")  # of two columns: out=(("x", "y"), "corr")
BOOLEAN = ("any", "all")
QUANTILES = ("median", "quantile")

Name = Callable[[str], str]  # a partial column's quoted name


def is_numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t) or pa.types.is_boolean(t)


def output_type(a: Agg) -> pa.DataType:
    return pa.bool_() if a.func in BOOLEAN else pa.int64() if a.func == "nunique" else pa.float64()


def _dbl(column: str | None) -> str:
    return f"CAST({kernels.quote_ident(column or '')} AS DOUBLE)"


def row_partial_sql(a: Agg, name: Name) -> list[str]:
    """Raw rows: the value (as DOUBLE for the numeric functions) that the final step aggregates."""
    if a.func in PAIRS:
        return [f"{_dbl(a.column)} AS {name('x')}", f"{_dbl(a.other)} AS {name('y')}"]
    if a.func in BOOLEAN or a.func == "nunique":
        return [f"{kernels.quote_ident(a.column or '')} AS {name('v')}"]
    return [f"{_dbl(a.column)} AS {name('x')}"]


def partial_sql(a: Agg, name: Name) -> list[str]:
    """One group's rows on one rank → its partial: count, mean and M2 (var/std); count, means,
    co-moment and, for corr, both M2 over the rows where both columns are set (cov/corr, as
    pandas and DuckDB pair them); bool_or / bool_and (any/all)."""
    if a.func in BOOLEAN:
        return [f"{'bool_or' if a.func == 'any' else 'bool_and'}({kernels.quote_ident(a.column or '')}) AS {name('v')}"]
    if a.func in ("std", "var"):
        x = _dbl(a.column)
        return [f"COUNT({x}) AS {name('n')}", f"AVG({x}) AS {name('m')}", f"var_pop({x}) * COUNT({x}) AS {name('m2')}"]
    # DuckDB's regr_* aggregates take the rows where both are set: the pairs' count, means,
    # co-moment Σ(x-x̄)(y-ȳ) and sums of squared deviations (x as their second argument)
    args = f"{_dbl(a.other)}, {_dbl(a.column)}"
    parts = [
        f"CAST(regr_count({args}) AS BIGINT) AS {name('n')}",
        f"regr_avgx({args}) AS {name('mx')}",
        f"regr_avgy({args}) AS {name('my')}",
        f"regr_sxy({args}) AS {name('c')}",
    ]
    if a.func == "corr":
        parts += [f"regr_sxx({args}) AS {name('m2x')}", f"regr_syy({args}) AS {name('m2y')}"]
    return parts


def window_sql(a: Agg, name: Name, over: str) -> list[str]:
    """The group's mean(s) next to every partial row: what Chan's formula centres on."""
    if a.func in ("std", "var"):
        means = [("m", "gm")]
    elif a.func in PAIRS:
        means = [("mx", "gmx"), ("my", "gmy")]
    else:
        return []
    n = name("n")
    return [f"SUM({n} * {name(m)}) OVER {over} / NULLIF(SUM({n}) OVER {over}, 0) AS {name(g)}" for m, g in means]


def _m2(name: Name, m2: str, m: str, gm: str) -> str:
    """A group's sum of squared deviations from its partials (Chan's parallel formula)."""
    return f"(SUM({name(m2)}) + SUM({name('n')} * ({name(m)} - {name(gm)}) * ({name(m)} - {name(gm)})))"


def combine_sql(a: Agg, name: Name) -> str:
    """The combine step over partial rows (with ``window_sql``'s columns) as a DuckDB expression;
    the degenerate cases as DuckDB's own aggregates give them: var/std/cov of fewer than 2
    values null; corr of no pairs null, of a constant column NaN."""
    n = f"SUM({name('n')})"
    if a.func == "any":
        return f"COALESCE(bool_or({name('v')}), false)"
    if a.func == "all":
        return f"COALESCE(bool_and({name('v')}), true)"
    if a.func in ("std", "var"):
        var = f"CASE WHEN {n} > 1 THEN {_m2(name, 'm2', 'm', 'gm')} / ({n} - 1) END"
        return f"sqrt({var})" if a.func == "std" else var
    co = f"(SUM({name('c')}) + SUM({name('n')} * ({name('mx')} - {name('gmx')}) * ({name('my')} - {name('gmy')})))"
    if a.func == "cov":
        return f"CASE WHEN {n} > 1 THEN {co} / ({n} - 1) END"
    sx, sy = (f"sqrt({_m2(name, m2, m, g)} / {n})" for m2, m, g in (("m2x", "mx", "gmx"), ("m2y", "my", "gmy")))
    return (
        f"CASE WHEN {n} > 0 THEN (CASE WHEN {sx} * {sy} = 0 THEN 'NaN'::DOUBLE ELSE {co} / {n} / ({sx} * {sy}) END) END"
    )


def raw_sql(a: Agg, name: Name) -> str:
    """The final step over raw rows (``row_partial_sql``'s columns): DuckDB's aggregates."""
    if a.func in BOOLEAN:
        return combine_sql(a, name)
    if a.func == "nunique":
        return f"CAST(COUNT(DISTINCT {name('v')}) AS BIGINT)"
    if a.func in QUANTILES:
        return f"quantile_cont({name('x')}, {float(a.q if a.q is not None else 0.5)!r})"
    fn = {"std": "stddev_samp", "var": "var_samp", "cov": "covar_samp", "corr": "corr"}[a.func]
    return f"{fn}({name('x')}, {name('y')})" if a.func in PAIRS else f"{fn}({name('x')})"


# ---- without keys: nunique and quantiles of whole columns --------------------------------------
def _canonical(col: pa.ChunkedArray) -> pa.ChunkedArray:
    """Equal values as DuckDB compares them get equal bits (so equal hashes): -0.0 → 0.0, one
    NaN; dictionaries decoded."""
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if pa.types.is_floating(col.type):
        col = pc.if_else(pc.is_nan(col), pa.scalar(math.nan, col.type), pc.add(col, pa.scalar(0.0, col.type)))
    return col


def distinct_counts(comm: Communicator, table: pa.Table, columns: Sequence[str]) -> list[int]:
    """Every column's distinct non-null values counted on the rank their hash picks, after one
    exchange of each rank's distinct values for all ``columns`` at once (each piece carries one
    column, the others null); the sum over ranks is the column's nunique."""
    distinct = {c: pc.drop_null(pc.unique(_canonical(table.column(c)))) for c in columns}
    schema = pa.schema([pa.field(c, v.type) for c, v in distinct.items()])
    pieces: list[list[pa.Table]] = [[] for _ in range(comm.world_size)]
    for c, values in distinct.items():
        one = pa.table({c: values})
        for dest, part in enumerate(kernels.hash_partition(one, [c], comm.world_size)):
            cols = [part.column(c) if f.name == c else pa.nulls(part.num_rows, f.type) for f in schema]
            pieces[dest].append(pa.table(cols, schema=schema))
    parts = [concat(p, schema) for p in pieces]
    if comm.world_size > 1:
        note(f"Exchange distinct values of {list(columns)} by hash: {rows(concat(parts, schema))}")
    received = concat(exchange_tables(comm, parts, schema), schema)
    return [int(pc.count_distinct(received.column(c), mode="only_valid").as_py()) for c in columns]


_BITS = 16  # bits of the code settled per round: 4 rounds, histograms of 65,536 buckets
_SIGN = np.uint64(1 << 63)


def select_codes(comm: Communicator, codes: Sequence[np.ndarray], wanted: Sequence[tuple[int, int]]) -> list[int]:
    """The code of global rank ``k`` (0-based, ascending) among every rank's ``codes[j]``, for
    each ``(j, k)`` of ``wanted`` (every rank asks the same), by radix selection: each round
    every rank histograms the next 16 bits of its codes that share the prefix found so far,
    one allreduce sums the histograms of all wanted ranks, and the bucket holding rank k
    extends the prefix.  Rows never move; ranks that share a prefix share a histogram."""
    if not wanted:
        return []
    state = [(j, k, 0) for j, k in wanted]
    candidates = {(j, 0): codes[j] for j in {j for j, _ in wanted}}
    for rnd in range(64 // _BITS):
        shift = np.uint64(64 - _BITS * (rnd + 1))
        groups = sorted({(j, prefix) for j, _, prefix in state})  # the same list on every rank
        digits = {g: ((candidates[g] >> shift) & np.uint64((1 << _BITS) - 1)).astype(np.intp) for g in groups}
        local = np.stack([np.bincount(digits[g], minlength=1 << _BITS) for g in groups]).astype(np.int64)
        total = comm.allreduce(local.ravel()).reshape(local.shape) if comm.world_size > 1 else local
        cumulative = {g: np.cumsum(total[i]) for i, g in enumerate(groups)}
        moved, nxt = [], {}
        for j, k, prefix in state:
            cum = cumulative[(j, prefix)]
            bucket = int(np.searchsorted(cum, k, side="right"))
            rest = k - (int(cum[bucket - 1]) if bucket else 0)
            extended = prefix | (bucket << int(shift))
            if (j, extended) not in nxt:
                nxt[(j, extended)] = candidates[(j, prefix)][digits[(j, prefix)] == bucket]
            moved.append((j, rest, extended))
        state, candidates = moved, nxt
    return [prefix for _, _, prefix in state]


def _decode(code: int) -> float:
    """The float64 whose order-preserving code (``sort._sort_codes``) this is."""
    c = np.uint64(code)
    bits = c ^ _SIGN if c & _SIGN else ~c
    return float(np.array([bits], dtype=np.uint64).view(np.float64)[0])


def global_quantiles(comm: Communicator, table: pa.Table, aggs: Sequence[Agg]) -> list[float | None]:
    """Each median/quantile agg over the whole column: DuckDB's ``quantile_cont`` (pandas'
    'linear'): the values at ranks ⌊(N-1)q⌋ and ⌈(N-1)q⌉ of the N non-null values (as DOUBLE),
    interpolated (``_interpolate``); null when N is 0."""
    columns = list(dict.fromkeys(a.column or "" for a in aggs))
    codes = []
    for c in columns:
        values = pc.drop_null(table.column(c)).cast(pa.float64())
        codes.append(
            _sort_codes(values.combine_chunks(), descending=False)[0] if len(values) else np.empty(0, np.uint64)
        )
    local = np.array([len(x) for x in codes], dtype=np.int64)
    counts = comm.allreduce(local) if comm.world_size > 1 else local
    spots = []
    for a in aggs:
        j = columns.index(a.column or "")
        position = (int(counts[j]) - 1) * float(a.q if a.q is not None else 0.5)
        spots.append((j, position, math.floor(position), math.ceil(position)))
    wanted = sorted({(j, k) for j, pos, lo, hi in spots if counts[j] for k in (lo, hi)})
    if comm.world_size > 1 and wanted:
        note(f"Radix selection of {len(wanted)} order statistics: 4 allreduce rounds, no rows move")
    found = dict(zip(wanted, (_decode(c) for c in select_codes(comm, codes, wanted))))
    out: list[float | None] = []
    for j, pos, lo, hi in spots:
        if not counts[j]:
            out.append(None)
        elif lo == hi:
            out.append(found[(j, lo)])
        else:
            out.append(_interpolate(found[(j, lo)], found[(j, hi)], pos - lo))
    return out


def _interpolate(low: float, high: float, frac: float) -> float:
    """``low·(1-frac) + high·frac`` as DuckDB's ``quantile_cont`` computes it (its build fuses
    the first product and the sum: one rounding, emulated exactly with fractions), so a
    global quantile equals the group-by's to the bit; infinities as DuckDB gives them."""
    if math.isfinite(low) and math.isfinite(high):
        return float(Fraction(low) * Fraction(1 - frac) + Fraction(high * frac))
    return low * (1 - frac) + high * frac
