"""The canary's parallel layout and virtual hosts, and the inter-host links a group's ring crosses."""

from __future__ import annotations

import itertools

import pytest

from rankwatch.base.schema import GroupKind
from rankwatch.base.topology import GroupInfo, Hosts, Layout, link_name


def test_layout_defaults_to_one_everywhere() -> None:
    assert Layout() == Layout(dp=1, tp=1, pp=1)
    assert Layout.parse("") == Layout()
    assert Layout.parse("tp=2") == Layout(dp=1, tp=2, pp=1)
    assert Layout().world_size == 1


def test_layout_parse_full_and_round_trip() -> None:
    layout = Layout.parse(" dp=2, tp=2 ,pp=2 ")
    assert layout == Layout(dp=2, tp=2, pp=2)
    assert layout.world_size == 8
    assert str(layout) == "dp=2,tp=2,pp=2"
    assert Layout.parse(str(Layout(dp=3, tp=1, pp=4))) == Layout(dp=3, tp=1, pp=4)


def test_layout_parse_with_nproc_gives_dp_the_rest() -> None:
    assert Layout.parse("tp=2,pp=2", nproc=8) == Layout(dp=2, tp=2, pp=2)
    assert Layout.parse("", nproc=4) == Layout(dp=4)
    assert Layout.parse("pp=4", nproc=8) == Layout(dp=2, tp=1, pp=4)
    assert Layout.parse("dp=2,tp=2,pp=2", nproc=8).world_size == 8


@pytest.mark.parametrize(
    ("text", "nproc", "fragment"),
    [
        ("dp=2,dp=2", None, "each at most once"),
        ("dp=2;tp=2", None, "expected comma-separated"),
        ("ep=2", None, "expected comma-separated"),
        ("dp=two", None, "expected comma-separated"),
        ("dp=-1", None, "expected comma-separated"),
        ("dp = 2", None, "expected comma-separated"),
        ("dp=0", None, "every degree must be >= 1"),
        ("tp=3", 8, "tp*pp=3 does not divide --nproc 8"),
        ("dp=2,tp=2", 8, "dp*tp*pp=4 but --nproc is 8"),
        ("dp=4", 2, "dp*tp*pp=4 but --nproc is 2"),
    ],
)
def test_layout_parse_errors(text: str, nproc: int | None, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        Layout.parse(text, nproc=nproc)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text", ["tp=0", "pp=0", "tp=2,pp=0"])
def test_layout_parse_zero_degree_with_nproc_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="every degree must be >= 1"):
        Layout.parse(text, nproc=4)


def test_layout_rejects_zero_degrees_directly() -> None:
    with pytest.raises(ValueError, match="pp=0"):
        Layout(pp=0)


@pytest.mark.parametrize(
    "layout",
    [Layout(), Layout(dp=8), Layout(tp=8), Layout(pp=8), Layout(dp=2, tp=2, pp=2), Layout(dp=3, tp=2, pp=4)],
)
def test_coords_and_rank_of_are_inverse(layout: Layout) -> None:
    seen = set()
    for rank in range(layout.world_size):
        dp, tp, pp = layout.coords(rank)
        assert 0 <= dp < layout.dp and 0 <= tp < layout.tp and 0 <= pp < layout.pp
        assert layout.rank_of(dp=dp, tp=tp, pp=pp) == rank
        seen.add((dp, tp, pp))
    assert seen == set(itertools.product(range(layout.dp), range(layout.tp), range(layout.pp)))


def test_rank_order_is_pp_dp_tp_with_tp_fastest() -> None:
    layout = Layout(dp=2, tp=2, pp=2)
    assert [layout.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0),
        (0, 0, 1), (0, 1, 1), (1, 0, 1), (1, 1, 1),
    ]  # fmt: skip


def test_hosts_fill_contiguously() -> None:
    hosts = Hosts(count=2, world_size=8)
    assert hosts.per_host == 4
    assert hosts.names == ["host0", "host1"]
    assert [hosts.host_of(r) for r in range(8)] == ["host0"] * 4 + ["host1"] * 4
    assert [hosts.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    one = Hosts(count=1, world_size=3)
    assert one.names == ["host0"] and {one.host_of(r) for r in range(3)} == {"host0"}
    assert [one.local_rank(r) for r in range(3)] == [0, 1, 2]
    per_rank = Hosts(count=4, world_size=4)
    assert [per_rank.host_of(r) for r in range(4)] == per_rank.names
    assert {per_rank.local_rank(r) for r in range(4)} == {0}


@pytest.mark.parametrize(("count", "world"), [(0, 8), (-1, 8), (3, 8), (16, 8)])
def test_hosts_must_divide_the_world(count: int, world: int) -> None:
    with pytest.raises(ValueError, match=f"--hosts {count} must be >= 1 and divide the world size {world}"):
        Hosts(count=count, world_size=world)


def test_tp_groups_stay_inside_a_host_and_pp_groups_cross() -> None:
    layout, hosts = Layout(dp=2, tp=2, pp=2), Hosts(count=2, world_size=8)
    for pp, dp in itertools.product(range(2), range(2)):
        tp_ranks = [layout.rank_of(dp=dp, tp=t, pp=pp) for t in range(2)]
        assert len({hosts.host_of(r) for r in tp_ranks}) == 1
    for dp, tp in itertools.product(range(2), range(2)):
        pp_ranks = [layout.rank_of(dp=dp, tp=tp, pp=p) for p in range(2)]
        assert {hosts.host_of(r) for r in pp_ranks} == {"host0", "host1"}


# -- GroupInfo.links -----------------------------------------------------------------------------------


def _info(ranks: tuple[int, ...], hosts: Hosts) -> GroupInfo:
    return GroupInfo(name="g", kind=GroupKind.OTHER, ranks=ranks, hosts=tuple(hosts.host_of(r) for r in ranks))


def test_intra_host_group_has_no_links() -> None:
    hosts = Hosts(count=2, world_size=8)
    assert _info((0, 1, 2, 3), hosts).links == ()
    assert _info((5, 6), hosts).links == ()


def test_group_spanning_two_hosts_crosses_their_link() -> None:
    hosts = Hosts(count=2, world_size=8)
    assert _info((0, 4), hosts).links == ("host0<->host1",)
    assert _info((4, 0), hosts).links == (link_name("host1", "host0"),)
    assert _info(tuple(range(8)), hosts).links == ("host0<->host1",)


def test_ring_links_are_sorted_and_unique() -> None:
    hosts = Hosts(count=4, world_size=4)
    ring = _info((0, 1, 2, 3), hosts)
    assert ring.links == ("host0<->host1", "host0<->host3", "host1<->host2", "host2<->host3")
    pair = GroupInfo(name="p", kind=GroupKind.PP, ranks=(0, 1, 2), hosts=("host2", "host0", "host2"))
    assert pair.links == ("host0<->host2",)


def test_degenerate_groups_have_no_links() -> None:
    assert GroupInfo(name="solo", kind=GroupKind.OTHER, ranks=(3,), hosts=("host1",)).links == ()
    assert GroupInfo(name="unknown", kind=GroupKind.OTHER, ranks=(0, 1), hosts=()).links == ()


def test_group_specs_cover_every_rank_once_per_kind() -> None:
    from rankwatch.base.schema import GroupKind
    from rankwatch.base.topology import group_specs

    layout = Layout(dp=2, tp=2, pp=2)
    specs = group_specs(layout)
    for kind, size in ((GroupKind.DP, 2), (GroupKind.TP, 2), (GroupKind.PP, 2)):
        groups = [ranks for k, _, ranks in specs if k == kind]
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == size for g in groups)
    names = {name: ranks for _, name, ranks in specs}
    assert names["dp.pp0.tp1"] == [1, 3]
    assert names["tp.pp1.dp0"] == [4, 5]
    assert names["pp.dp1.tp0"] == [2, 6]
