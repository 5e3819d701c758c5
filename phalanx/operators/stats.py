"""The statistical aggregations of ``groupby(...).agg`` and ``agg``: std, var, corr, cov, any,
all, quantile_approx, median, quantile and nunique.

quantile_approx is decomposable: each rank's partial is a sketch of at most ``APPROX_POINTS``
values per group, merged by the combine step with a stated rank error (``finish_sketches``).

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

DECOMPOSABLE = ("std", "var", "corr", "cov", "any", "all", "quantile_approx")
HOLISTIC = ("median", "quantile", "nunique")
FUNCS = DECOMPOSABLE + HOLISTIC
NUMERIC = ("std", "var", "median", "quantile", "quantile_approx", "corr", "cov")  # ints, floats, decimals, bools
PAIRS = ("corr", "cov")  # of two columns: out=(("x", "y"), "corr")
BOOLEAN = ("any", "all")
QUANTILES = ("median", "quantile", "quantile_approx")
APPROX_POINTS = 1000  # K: a quantile_approx partial keeps at most K values of its group and rank
WITH_Q = ("quantile", "quantile_approx")  # a third spec element is q
WITH_DDOF = ("std", "var")  # a third spec element is ddof

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
    if a.func == "quantile_approx":  # the sketch: all n sorted values, or K at ranks ⌈(j-½)n/K⌉
        x, k = _dbl(a.column), APPROX_POINTS
        n, values = f"COUNT({x})", f"list_sort(list({x}) FILTER (WHERE {x} IS NOT NULL))"
        ranks = f"list_transform(range(1, {k + 1}), lambda j: ((2 * j - 1) * {n} + {2 * k - 1}) // {2 * k})"
        return [
            f"{n} AS {name('n')}",
            f"CASE WHEN {n} <= {k} THEN {values} ELSE list_select({values}, {ranks}) END AS {name('p')}",
        ]
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
    if a.func == "quantile_approx":  # the group's sketches, merged after the query: finish_sketches
        return f"list(struct_pack(n := {name('n')}, p := {name('p')})) FILTER (WHERE {name('n')} > 0)"
    if a.func in ("std", "var"):
        var = f"CASE WHEN {n} > {a.ddof} THEN {_m2(name, 'm2', 'm', 'gm')} / ({n} - {a.ddof}) END"
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
    if a.func in WITH_DDOF and a.ddof != 1:  # pandas' ddof: M2 / (n - ddof), null unless n > ddof
        x, n = name("x"), f"COUNT({name('x')})"
        var = f"CASE WHEN {n} > {a.ddof} THEN var_pop({x}) * {n} / ({n} - {a.ddof}) END"
        return f"sqrt({var})" if a.func == "std" else var
    fn = {"std": "stddev_samp", "var": "var_samp", "cov": "covar_samp", "corr": "corr"}[a.func]
    return f"{fn}({name('x')}, {name('y')})" if a.func in PAIRS else f"{fn}({name('x')})"


def finish_sketches(table: pa.Table, aggs: Sequence[Agg]) -> pa.Table:
    """Every quantile_approx column of the combine step's result (per group, a list of each
    rank's sketch: its count n and its points) replaced by the quantile the merged sketch gives.

    A rank with n ≤ K values sent them all (each of weight 1); one with more sent the values at
    ranks ⌈(j − ½)n/K⌉, j = 1..K, each standing for n/K values: its count of values ≤ x is then
    estimated within ±n/2K.  Over the group, the estimate C̃(x) is within ±E/2 of the true count
    C(x), E = Σ n/K of the sketched ranks ≤ N/K.  For a target rank r the answer is the smallest
    point with C̃ ≥ r, so its rank is within E/2 of r: between the exact order statistics of
    ranks ⌈r − E/2⌉ and ⌈r + E/2⌉.  As quantile_cont, r is ⌊p⌋ and ⌈p⌉ for p = 1 + q(N−1),
    interpolated; exact (to rounding) when no rank holds more than K values of the group.
    Weights are scaled by K to stay integers."""
    for a in aggs:
        if a.func == "quantile_approx" and pa.types.is_list(table.schema.field(a.out).type):
            col = table.column(a.out).combine_chunks()
            value = _merged_quantile(col, float(a.q if a.q is not None else 0.5))
            table = table.set_column(table.column_names.index(a.out), a.out, value)
    return table


def _merged_quantile(col: pa.Array, q: float) -> pa.Array:
    """``finish_sketches`` for one column of G groups, vectorised over every group's points."""
    k, g = APPROX_POINTS, len(col)
    sketches = pc.list_flatten(col)
    if not len(sketches):
        return pa.nulls(g, pa.float64())
    group = np.asarray(pc.list_parent_indices(col))
    n = np.asarray(sketches.field("n"), dtype=np.int64)
    points = sketches.field("p")
    values = np.asarray(pc.list_flatten(points), dtype=np.float64)
    owner = np.asarray(pc.list_parent_indices(points))
    sketched = n > np.asarray(pc.list_value_length(points).fill_null(0), dtype=np.int64)
    total = np.bincount(group, weights=n, minlength=g).astype(np.int64)  # N
    gid = group[owner]
    order = np.lexsort((values, gid))  # NaN after every number, as DuckDB sorts
    values, gid = values[order], gid[order]
    cum = np.cumsum(np.where(sketched, n, k)[owner][order])  # each point: K × n/m
    starts = np.searchsorted(gid, np.arange(g), side="left")
    ends = np.searchsorted(gid, np.arange(g), side="right")
    has = ends > starts
    base = np.where(starts > 0, cum[np.maximum(starts - 1, 0)], 0)
    pos = 1 + q * (np.maximum(total, 1) - 1)
    lo, hi = np.floor(pos).astype(np.int64), np.ceil(pos).astype(np.int64)
    last = np.maximum(ends - 1, starts)
    safe = np.minimum(last, len(values) - 1)
    low = values[np.minimum(np.clip(np.searchsorted(cum, base + k * lo), starts, last), safe)]
    high = values[np.minimum(np.clip(np.searchsorted(cum, base + k * hi), starts, last), safe)]
    frac = pos - lo
    with np.errstate(invalid="ignore"):
        out = np.where(frac == 0, low, low * (1 - frac) + high * frac)
    return pa.array(out, pa.float64(), mask=~has)


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
