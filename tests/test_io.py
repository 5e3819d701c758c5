"""Parquet and CSV split across ranks, checked against pyarrow/pandas reading the same files."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from reference import assert_same_rows, make_part, whole

import phalanx as px


def app_write_then_read(env, directory):
    df = px.DataFrame.from_arrow(make_part(env.rank, env.world_size), env)
    df.write_parquet(directory)
    back = px.read_parquet(directory, env)
    return back.collect(root=0), back.local_num_rows


def test_write_parquet_one_file_per_rank_and_read_back(gang, tmp_path):
    out = tmp_path / "frame"
    results = gang.run(app_write_then_read, str(out))
    n = gang.world_size
    assert sorted(p.name for p in out.iterdir()) == [f"part-{r:05d}.parquet" for r in range(n)]
    assert results[0][0].equals(whole(n))
    assert pq.read_table(out / "part-00000.parquet").equals(make_part(0, n))


def app_read(env, path, columns=None):
    df = px.read_parquet(path, env, columns=columns)
    return df.collect(root=0), df.local_num_rows


def test_read_parquet_splits_row_groups_of_one_file_across_ranks(gang, tmp_path):
    t = whole(4, rows=5000)
    pq.write_table(t, tmp_path / "one.parquet", row_group_size=1000)
    results = gang.run(app_read, str(tmp_path / "one.parquet"))
    assert results[0][0].equals(t)
    sizes = [r[1] for r in results]
    assert max(sizes) - min(sizes) <= 2000  # balanced to within a row group or two


def test_read_parquet_glob_with_column_selection_and_promoted_types(gang, tmp_path):
    parts = []
    for i in range(5):
        t = make_part(i, 5, rows=300, seed=7).select(["key", "w", "s"])
        if i % 2:  # an int32 file among int64 files: the schemas are unified
            t = t.cast(pa.schema([("key", pa.int64()), ("w", pa.int32()), ("s", pa.string())]))
        pq.write_table(t, tmp_path / f"f{i}.parquet")
        parts.append(t.select(["w", "key"]).cast(pa.schema([("w", pa.int64()), ("key", pa.int64())])))
    out = gang.run(app_read, str(tmp_path / "f*.parquet"), ["w", "key"])[0][0]
    assert out.equals(pa.concat_tables(parts))


def test_read_parquet_unknown_column_fails_on_every_rank(gang, tmp_path):
    pq.write_table(pa.table({"a": [1]}), tmp_path / "a.parquet")
    with pytest.raises(px.RankError) as info:
        gang.run(app_read, str(tmp_path), ["zz"])
    assert info.value.ranks == list(range(gang.world_size))
    assert "unknown column(s) ['zz']" in str(info.value)


@pytest.mark.slow  # several seconds (a CLI run, a Ctrl-C, or 1-4 rank gangs): out of the core lane's 5 minutes
def test_a_corrupt_parquet_page_names_the_file_row_group_and_column(gang, tmp_path):
    """pyarrow says only "Corrupt snappy compressed data" (issue 22 item 21): every rank that
    reads the damaged page names the file, row group and column."""
    path = tmp_path / "damaged.parquet"
    t = pa.table({"a": np.arange(10_000), "b": [f"s{i}" for i in range(10_000)]})
    pq.write_table(t, path, row_group_size=5000, compression="snappy")
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)  # column 'a' of row group 1
    middle = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[middle : middle + 64] = bytes(b ^ 0x5A for b in data[middle : middle + 64])  # inside a page
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="Corrupt snappy"):  # what pyarrow says, naming nothing
        pq.ParquetFile(path).read_row_group(1)
    with pytest.raises(px.RankError) as info:
        gang.run(app_read, str(path))
    said = f"read_parquet: cannot read {str(path)!r}, row group 1, column 'a': Corrupt snappy compressed data"
    assert said in str(info.value)


@pytest.mark.slow  # several seconds (a CLI run, a Ctrl-C, or 1-4 rank gangs): out of the core lane's 5 minutes
def test_a_csv_conversion_pyarrow_cannot_do_names_the_file(gang, tmp_path):
    (tmp_path / "a.csv").write_text("k,x\n1,2\n")
    with pytest.raises(px.RankError, match=r"read_csv: '.*a\.csv' \(bytes 0-\d+\): .*not supported"):
        gang.run(app_csv, str(tmp_path / "a.csv"), {"x": pa.list_(pa.int64())})


def app_csv(env, path, column_types=None):
    df = px.read_csv(path, env, column_types=column_types)
    return df.collect(root=0), df.local_num_rows


@pytest.mark.slow  # several seconds (a CLI run, a Ctrl-C, or 1-4 rank gangs): out of the core lane's 5 minutes
def test_read_csv_splits_one_file_at_line_boundaries(gang, tmp_path):
    rng = np.random.default_rng(3)
    n = 20_000
    frame = pd.DataFrame(
        {"id": np.arange(n), "x": rng.normal(size=n).round(6), "name": rng.choice(["a", "bb", "c,c", 'd"d', ""], n)}
    )
    path = tmp_path / "big.csv"
    frame.to_csv(path, index=False)
    results = gang.run(app_csv, str(path))
    out = results[0][0]
    expected = pa.Table.from_pandas(pd.read_csv(path, keep_default_na=False), preserve_index=False)
    assert out["id"].to_pylist() == list(range(n))  # no line lost or read twice, order kept
    assert_same_rows(out.cast(expected.schema), expected)
    if gang.world_size > 1:
        assert min(r[1] for r in results) > 0  # every rank read a share


def test_read_csv_ranks_agree_on_types(gang, tmp_path):
    # the first file has only integers in "x", the second floats: the frame's "x" is float64
    (tmp_path / "a.csv").write_text("k,x\n" + "".join(f"{i},{i}\n" for i in range(50)))
    (tmp_path / "b.csv").write_text("k,x\n" + "".join(f"{i},{i}.5\n" for i in range(50, 100)))
    out = gang.run(app_csv, str(tmp_path / "*.csv"))[0][0]
    assert out.schema.field("x").type == pa.float64()
    assert sorted(out["x"].to_pylist()) == sorted([float(i) for i in range(50)] + [i + 0.5 for i in range(50, 100)])
