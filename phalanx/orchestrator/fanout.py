"""Fan-out (``foreach:``): a stage run once per item, each item a stage instance of its own.

Instance ``i`` of stage ``train`` is the stage ``train.i``: the template's definition with the
item merged into its params, its outputs renamed ``OUT.i`` (the app still writes
``env.output("OUT", ...)``: ``Workflow._aliases``), its own gang, retries, status line and
report lane.  Stages downstream are rewritten to need every instance; an input that reads a
fanned-out dataset becomes one part input per instance (``models.0``, ``models.1``...) that the
rank gathers back into one frame or a list (``Workflow._gathers``, ``StageContext.input``) —
so crossing sites, locality, lineage and fingerprints work per part as for any input.

Static fan-outs (``items``, ``matrix``) are expanded before the run starts; a fan-out over the
``rows`` of a dataset is expanded by the scheduler once the stage that seals it has run.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from .models import MAX_NAME, ForEach, Workflow


def static_items(fe: ForEach) -> list[dict[str, Any]] | None:
    """The instances' params of a fan-out over items or a matrix; None for one over rows."""
    if fe.items is not None:
        return [item_params(item) for item in fe.items]
    if fe.matrix is not None:
        keys = list(fe.matrix)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(fe.matrix[k] for k in keys))]
    return None


def item_params(item: Any) -> dict[str, Any]:
    """An item's params: a mapping as it is, any other value as ``item``."""
    return dict(item) if isinstance(item, Mapping) else {"item": item}


def row_items(table: Any, fe: ForEach, stage: str) -> list[dict[str, Any]]:
    """The instances' params of a fan-out over the rows of ``table`` (an Arrow table)."""
    if table.num_rows > fe.max:
        raise ValueError(
            f"stage {stage!r}: foreach over the rows of {fe.rows!r} would make {table.num_rows:,} instances, "
            f"more than foreach.max ({fe.max:,})"
        )
    return table.to_pylist()


def instance_name(stage: str, index: int) -> str:
    return f"{stage}.{index}"


def longest_name(stage: str, outputs: list[str], count: int) -> str | None:
    """A problem when the instances' names (``stage.N``, ``OUT.N``) would be too long."""
    suffix = len(str(max(count - 1, 0))) + 1
    for name in [stage, *outputs]:
        if len(name) + suffix > MAX_NAME:
            return f"{name!r} + '.{count - 1}' is longer than {MAX_NAME} characters: shorten the name"
    return None


def expand(wf: Workflow, name: str, items: list[dict[str, Any]]) -> Workflow:
    """``wf`` with stage ``name`` replaced by one instance per item (in order), and the stages
    downstream of it rewritten to read and need the instances."""
    template = wf.stages[name]
    names = [instance_name(name, i) for i in range(len(items))]
    fanned = {out: [f"{out}.{i}" for i in range(len(items))] for out in template.outputs}
    stages: dict[str, Any] = {}
    aliases, gathers = dict(wf._aliases), {k: dict(v) for k, v in wf._gathers.items()}
    instance_of, datasets, given = dict(wf._instance_of), dict(wf._fanned), dict(wf._items)
    for stage, st in wf.stages.items():
        if stage != name:
            stages[stage] = _consumer(st, name, names, fanned, gathers.setdefault(stage, {}))
            continue
        for i, item in enumerate(items):
            inst = names[i]
            stages[inst] = st.model_copy(
                update={
                    "foreach": None,
                    "params": {**st.params, **item},
                    "outputs": [fanned[o][i] for o in st.outputs],
                },
                deep=True,
            )
            instance_of[inst] = wf.template_of(name)
            given[inst] = {**wf._items.get(name, {}), **item}
            aliases[inst] = {o: fanned[o][i] for o in st.outputs}
    datasets.update(fanned)
    out = wf.model_copy(update={"stages": stages})
    out._apps = wf._apps
    out._instance_of, out._aliases, out._fanned, out._items = instance_of, aliases, datasets, given
    out._gathers = {k: v for k, v in gathers.items() if v}
    return out


def _consumer(st: Any, template: str, names: list[str], fanned: dict[str, list[str]], gathers: dict) -> Any:
    """A stage of the workflow, rewritten for the fan-out of ``template`` into ``names``."""
    from .conditions import datasets_named

    needs = [x for need in st.needs for x in (names if need == template else [need])]
    reads = set(datasets_named(st.when)) if st.when else set()
    if st.foreach is not None and st.foreach.rows:
        reads.add(st.foreach.rows)
    if reads & set(fanned):  # a condition or a fan-out over rows reads the instances' outputs
        needs += [n for n in names if n not in needs]
    if not any(spec.dataset in fanned for spec in st.inputs.values()) and needs == st.needs:
        return st
    inputs = {}
    for local, spec in st.inputs.items():
        parts = fanned.get(spec.dataset)
        if parts is None:
            inputs[local] = spec
            continue
        part_names = [f"{local}.{i}" for i in range(len(parts))]
        for part, dataset in zip(part_names, parts):
            inputs[part] = spec.model_copy(update={"dataset": dataset, "gather": None})
        gathers[local] = (spec.gather or "concat", part_names)
    return st.model_copy(update={"needs": needs, "inputs": inputs})


def expand_static(wf: Workflow) -> Workflow:
    """Every fan-out over items or a matrix expanded (those over rows wait for their data)."""
    for name in list(wf.stages):
        st = wf.stages[name]
        items = static_items(st.foreach) if st.foreach is not None else None
        if items is not None:
            wf = expand(wf, name, items)
    return wf


def fanout_plan(wf: Workflow) -> list[str]:
    """What ``phalanx validate`` says of each fan-out: how many instances, or what decides."""
    lines = []
    for name, st in wf.stages.items():
        if st.foreach is None:
            continue
        items = static_items(st.foreach)
        if items is None:
            lines.append(
                f"  {name}: foreach over the rows of {st.foreach.rows!r}: instances known at run time "
                f"(at most {st.foreach.max:,})"
            )
        else:
            shown = (
                f"{name}.0 … {name}.{len(items) - 1}"
                if len(items) > 2
                else ", ".join(instance_name(name, i) for i in range(len(items)))
            )
            lines.append(f"  {name}: foreach makes {len(items)} instance{'' if len(items) == 1 else 's'} ({shown})")
    return lines


def gathered_inputs(wf: Workflow, stage: str, skipped: set[str]) -> dict[str, dict[str, Any]]:
    """What a rank of ``stage`` reads, as ``StageContext`` takes it: every input's get() spec,
    and for each gathered input ``{"gather": mode, "parts": [...], "items": [...]}`` over the
    part inputs whose instance ran (those of instances skipped by their ``when:`` are left out),
    ``items`` the item of each part's instance (``env.inputs[name]["items"]``: which config made
    which frame)."""
    st = wf.stages[stage]
    producers = {out: s for s, other in wf.stages.items() for out in other.outputs}
    left_out = {local for local, spec in st.inputs.items() if producers.get(spec.dataset) in skipped}
    inputs = {k: v.model_dump(exclude_none=True) for k, v in st.inputs.items() if k not in left_out}
    for local, (mode, parts) in wf._gathers.get(stage, {}).items():
        kept = [p for p in parts if p not in left_out]
        items = [wf._items.get(producers.get(st.inputs[p].dataset, ""), {}) for p in kept]
        inputs[local] = {"gather": mode, "parts": kept, "items": items}
    return inputs
