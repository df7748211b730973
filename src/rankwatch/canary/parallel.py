"""The canary's process groups: every dp, tp and pp group of its layout, created on torch.distributed.

The layout, its group specs and the virtual hosts are topology nouns (`rankwatch.base.topology`); this module makes
the torch objects for one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rankwatch.base.schema import GroupKind
from rankwatch.base.topology import GroupInfo, Hosts, Layout, group_specs


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroups:
    """This rank's process groups (torch objects) with their telemetry descriptions."""

    world: Any
    dp: Any
    tp: Any
    pp: Any
    infos: dict[str, GroupInfo]
    dp_info: GroupInfo
    tp_info: GroupInfo
    pp_info: GroupInfo


def build_groups(
    layout: Layout, hosts: Hosts, rank: int, *, timeout: timedelta
) -> tuple[RankGroups, list[tuple[Any, GroupInfo]]]:
    """Create every dp, tp and pp group (all ranks must call this, in the same order).

    `timeout` must be given: a new group does not inherit the world group's timeout (it defaults to 30 minutes).
    Returns this rank's groups and the (group, info) pairs of the groups it belongs to."""

    def info(name: str, kind: GroupKind, ranks: list[int]) -> GroupInfo:
        return GroupInfo(name=name, kind=kind, ranks=tuple(ranks), hosts=tuple(hosts.host_of(r) for r in ranks))

    mine: dict[GroupKind, tuple[Any, GroupInfo]] = {
        GroupKind.WORLD: (dist.GroupMember.WORLD, info("world", GroupKind.WORLD, list(range(layout.world_size))))
    }
    for kind, name, ranks in group_specs(layout):
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine[kind] = (group, info(name, kind, ranks))
    groups = RankGroups(
        world=mine[GroupKind.WORLD][0],
        dp=mine[GroupKind.DP][0],
        tp=mine[GroupKind.TP][0],
        pp=mine[GroupKind.PP][0],
        infos={i.name: i for _, i in mine.values()},
        dp_info=mine[GroupKind.DP][1],
        tp_info=mine[GroupKind.TP][1],
        pp_info=mine[GroupKind.PP][1],
    )
    return groups, list(mine.values())
