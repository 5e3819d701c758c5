"""Why a gang's placement group cannot be placed, in one line: Ray's scheduling state, what the
cluster has, and which of the gang's needs it cannot meet.

``diagnose`` works on plain data (Ray's node table), so it is tested without a cluster;
``why_unplaceable`` asks Ray for that data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def fmt_bundle(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def describe(bundles: Sequence[dict[str, float]], strategy: str) -> str:
    """``4×{CPU: 1} STRICT_SPREAD``; ``1×{CPU: 1, node_a: 1} + 1×{CPU: 1, node_b: 1} PACK``."""
    kinds: dict[str, int] = {}
    for b in bundles:
        kinds[fmt_bundle(b)] = kinds.get(fmt_bundle(b), 0) + 1
    return " + ".join(f"{count}×{b}" for b, count in kinds.items()) + f" {strategy}"


def diagnose(state: str, nodes: Sequence[dict[str, Any]], bundles: Sequence[dict[str, float]], strategy: str) -> str:
    """``state``: Ray's scheduling state of the group (INFEASIBLE, PENDING...); ``nodes``: the
    live nodes as ``ray.nodes()`` gives them (their ``Resources``)."""
    fits = [nd for nd in nodes if any(_fits(b, nd["Resources"]) for b in bundles)]
    need = sorted({k for b in bundles for k in b})
    totals = {k: sum(nd["Resources"].get(k, 0.0) for nd in nodes) for k in need}
    parts = [f"Ray says {state}", f"cluster has {len(nodes)} node{'s' * (len(nodes) != 1)}"]
    if len(fits) < len(nodes):
        parts.append(f"{len(fits)} of them can hold a bundle")
    parts.append("total " + fmt_bundle(totals))
    if strategy == "STRICT_SPREAD" and len(bundles) > len(fits):
        parts.append(f"STRICT_SPREAD needs {len(bundles)} distinct nodes")
    elif strategy == "STRICT_PACK" and not any(_fits(_sum(bundles), nd["Resources"]) for nd in nodes):
        parts.append(f"STRICT_PACK needs one node with {fmt_bundle(_sum(bundles))}")
    elif any(totals[k] < sum(b.get(k, 0.0) for b in bundles) for k in need):
        parts.append(f"the gang needs {fmt_bundle(_sum(bundles))}")
    else:
        parts.append("the resources are busy (other placement groups, actors or tasks)")
    return "; ".join(parts)


def why_unplaceable(ray, pg, bundles: Sequence[dict[str, float]], strategy: str) -> str:
    """``diagnose`` of placement group ``pg`` with what Ray says now."""
    from ray.util.placement_group import placement_group_table

    try:
        table = placement_group_table(pg)
        state = table.get("stats", {}).get("scheduling_state") or table.get("state", "?")
        nodes = [nd for nd in ray.nodes() if nd.get("Alive")]
    except Exception as exc:
        return f"(could not ask Ray why: {exc})"
    return diagnose(state, nodes, bundles, strategy)


def _fits(bundle: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0.0) >= v for k, v in bundle.items())


def _sum(bundles: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for b in bundles:
        for k, v in b.items():
            out[k] = out.get(k, 0.0) + v
    return out
