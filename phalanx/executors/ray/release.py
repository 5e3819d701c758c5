"""Free a gang's placement group and rank actors from any process: what ``phalanx status``,
``cancel`` and ``--resume`` do for a driver that died holding one (``base.held`` recorded it)."""

from __future__ import annotations

from .connection import connection_to


def release(record: dict) -> str:
    """Kill the rank actors and remove the placement group of a gang recorded by
    ``RayLauncher.launch`` (connecting to the record's cluster for the call if this process is
    not connected); a human line saying what was done."""
    with connection_to(record["address"], record.get("namespace"), site="release") as ray:
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

        actors = 0
        for r in range(int(record.get("ranks", 0))):
            try:
                ray.kill(ray.get_actor(f"{record['id']}-rank{r}", namespace=record.get("namespace")), no_restart=True)
                actors += 1
            except ValueError:  # no such live actor
                pass
        groups = [
            pg_id
            for pg_id, t in placement_group_table().items()
            if t.get("name") == record["id"] and t.get("state") != "REMOVED"
        ]
        for pg_id in groups:
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
    if not (actors or groups):
        return f"ray: placement group {record['id']} already gone"
    return f"ray: removed placement group {record['id']} and killed {actors} rank actor(s)"
