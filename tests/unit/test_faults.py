"""Fault specs: parsing, one-line errors, the immutable chainable set and the questions the trainer asks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rankwatch.base.schema import ThrottleReason
from rankwatch.base.topology import link_name
from rankwatch.canary.faults import (
    FAULT_HELP, FAULT_KEYS, THROTTLE_REASONS, BadDevice, BitFlip, DeviceError, Exit, FailingDevice, Fault, FaultKind,
    Faults, FlipTarget, Freeze, GpuSlow, Hang, Kill, Nudge, SkewData, SkewRng, Slow, SlowLink, Throttle, fault_spec,
    parse_fault,
)
from rankwatch.canary.loop import ExtraCompute

HOSTS = ["host0", "host1", "host2", "host3"]

# One spec per kind with every key given, and what it parses to.
FULL: dict[FaultKind, tuple[str, Fault]] = {
    FaultKind.SLOW: (
        "slow:rank=2,from=10,delay=0.2,until=30,period=4,burst=2",
        Slow(rank=2, from_step=10, delay_s=0.2, until_step=30, period=4, burst=2),
    ),
    FaultKind.EXIT: ("exit:rank=3,step=40,code=7", Exit(rank=3, step=40, code=7)),
    FaultKind.KILL: ("kill:rank=1,step=5,signal=15", Kill(rank=1, step=5, signal=15)),
    FaultKind.HANG: ("hang:rank=0,step=12", Hang(rank=0, step=12)),
    FaultKind.BITFLIP: (
        "bitflip:rank=1,step=9,target=param,bit=62,param=3,index=17",
        BitFlip(rank=1, step=9, target=FlipTarget.PARAM, bit=62, param=3, index=17),
    ),
    FaultKind.SKEW_RNG: ("skew_rng:rank=2,step=4", SkewRng(rank=2, step=4)),
    FaultKind.SKEW_DATA: ("skew_data:rank=3,step=6,offset=8", SkewData(rank=3, step=6, offset=8)),
    FaultKind.THROTTLE: (
        "throttle:rank=0,from=3,delay=0.05,until=9,reason=power",
        Throttle(rank=0, from_step=3, delay_s=0.05, until_step=9, reason="power"),
    ),
    FaultKind.BAD_DEVICE: (
        "bad_device:host=1,index=2,from=5,delay=0.04,until=50,reason=power",
        BadDevice(host=1, index=2, from_step=5, delay_s=0.04, until_step=50, reason="power"),
    ),
    FaultKind.SLOW_LINK: (
        "slow_link:hosts=0-1,from=2,delay=0.1,until=8",
        SlowLink(host_a=0, host_b=1, from_step=2, delay_s=0.1, until_step=8),
    ),
    FaultKind.NUDGE: ("nudge:param=2,index=7", Nudge(param=2, index=7)),
    FaultKind.GPU_SLOW: ("gpu_slow:rank=1,from=20,factor=1.5,until=60",
                         GpuSlow(rank=1, from_step=20, factor=1.5, until_step=60)),
    FaultKind.FREEZE: ("freeze:rank=2,step=30,seconds=4.0", Freeze(rank=2, step=30, seconds=4.0)),
    FaultKind.FAILING_DEVICE: ("failing_device:host=1,index=0,step=23", FailingDevice(host=1, index=0, step=23)),
    FaultKind.DEVICE_ERROR: ("device_error:rank=2,step=7", DeviceError(rank=2, step=7)),
}

# The shortest valid spec per kind, and what it parses to (defaults filled in).
MINIMAL: dict[FaultKind, tuple[str, Fault]] = {
    FaultKind.SLOW: ("slow:rank=2,delay=0.2", Slow(rank=2, delay_s=0.2)),
    FaultKind.EXIT: ("exit:rank=3,step=40", Exit(rank=3, step=40, code=1)),
    FaultKind.KILL: ("kill:rank=1,step=5", Kill(rank=1, step=5, signal=9)),
    FaultKind.HANG: ("hang:rank=0,step=12", Hang(rank=0, step=12)),
    FaultKind.BITFLIP: ("bitflip:rank=1,step=9", BitFlip(rank=1, step=9, target=FlipTarget.GRAD, bit=30)),
    FaultKind.SKEW_RNG: ("skew_rng:rank=2,step=4", SkewRng(rank=2, step=4)),
    FaultKind.SKEW_DATA: ("skew_data:rank=3,step=6", SkewData(rank=3, step=6, offset=1)),
    FaultKind.THROTTLE: ("throttle:rank=0", Throttle(rank=0, delay_s=0.02, reason="thermal")),
    FaultKind.BAD_DEVICE: ("bad_device:host=0,index=1", BadDevice(host=0, index=1)),
    FaultKind.SLOW_LINK: ("slow_link:hosts=1-0,delay=0.1", SlowLink(host_a=1, host_b=0, delay_s=0.1)),
    FaultKind.NUDGE: ("nudge:", Nudge()),
    FaultKind.GPU_SLOW: ("gpu_slow:rank=0,factor=2", GpuSlow(rank=0, factor=2.0)),
    FaultKind.FREEZE: ("freeze:rank=0,step=1,seconds=1", Freeze(rank=0, step=1, seconds=1.0)),
    FaultKind.FAILING_DEVICE: ("failing_device:host=0,index=1,step=0", FailingDevice(host=0, index=1, step=0)),
    FaultKind.DEVICE_ERROR: ("device_error:rank=0,step=3", DeviceError(rank=0, step=3)),
}


def test_every_kind_has_examples() -> None:
    assert set(FULL) == set(FaultKind) == set(MINIMAL)


@pytest.mark.parametrize("kind", list(FaultKind))
def test_parse_every_kind_and_round_trip(kind: FaultKind) -> None:
    for spec, expected in (FULL[kind], MINIMAL[kind]):
        fault = parse_fault(spec)
        assert fault == expected
        assert type(fault) is type(expected)
        assert fault_spec(fault).startswith(f"{kind}:")
        assert parse_fault(fault_spec(fault)) == fault
    assert fault_spec(FULL[kind][1]) == FULL[kind][0]


def test_parse_tolerates_whitespace_and_empty_items() -> None:
    assert parse_fault("  exit: rank=1 , step=2 ,, ") == Exit(rank=1, step=2)


def test_help_names_every_kind() -> None:
    for kind in FaultKind:
        assert f"{kind}:" in FAULT_HELP


def _error(spec: str) -> str:
    with pytest.raises(ValueError) as info:
        parse_fault(spec)
    message = str(info.value)
    assert "\n" not in message, f"multi-line error for {spec!r}: {message!r}"
    return message


def test_unknown_kind_lists_valid_kinds() -> None:
    message = _error("explode:rank=1,step=2")
    assert "'explode'" in message
    for kind in FaultKind:
        assert str(kind) in message


def test_unknown_key_lists_valid_keys() -> None:
    message = _error("slow:rank=1,delay=0.1,speed=3")
    assert "speed=3" in message
    for key in ("rank", "from", "delay", "until", "period", "burst"):
        assert key in message


def test_item_without_equals_is_an_error() -> None:
    assert "valid keys: rank, step" in _error("hang:rank=1,step")


@pytest.mark.parametrize(
    ("spec", "missing"),
    [
        ("slow:rank=1", "delay="),
        ("slow:delay=0.1", "rank="),
        ("exit:rank=1", "step="),
        ("kill:step=3", "rank="),
        ("hang:", "rank=, step="),
        ("bitflip", "rank=, step="),
        ("throttle:delay=0.1", "rank="),
        ("slow_link:delay=0.1", "hosts="),
        ("slow_link:hosts=0-1", "delay="),
    ],
)
def test_missing_required_key(spec: str, missing: str) -> None:
    message = _error(spec)
    assert "missing" in message and missing in message


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("slow:rank=one,delay=0.1", "rank='one' is not an integer"),
        ("slow:rank=1,delay=fast", "delay='fast' is not a number"),
        ("exit:rank=1,step=2.5", "step='2.5' is not an integer"),
        ("skew_data:rank=1,step=2,offset=x", "offset='x' is not an integer"),
        ("slow_link:hosts=0-1,delay=slow", "delay='slow' is not a number"),
    ],
)
def test_non_numeric_values(spec: str, fragment: str) -> None:
    assert fragment in _error(spec)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("exit:rank=-1,step=3", "rank must be >= 0"),
        ("hang:rank=0,step=-2", "step must be >= 0"),
        ("slow:rank=0,from=-1,delay=0.1", "from_step must be >= 0"),
        ("slow:rank=0,delay=-0.1", "delay must be >= 0"),
        ("throttle:rank=0,delay=-1", "delay must be >= 0"),
        ("bitflip:rank=0,step=1,bit=-1", "bit must be >= 0"),
        ("bitflip:rank=0,step=1,bit=64", "bit must be in 0..63"),
        ("bitflip:rank=0,step=1,index=-3", "index must be >= 0"),
        ("slow:rank=0,delay=0.1,period=0", "period must be >= 1"),
    ],
)
def test_negative_and_out_of_range_values(spec: str, fragment: str) -> None:
    assert fragment in _error(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "slow:rank=0,delay=0.1,period=4,burst=-1",
        "slow:rank=0,delay=0.1,until=-5",
        "throttle:rank=0,until=-1",
        "slow_link:hosts=0-1,delay=0.1,until=-2",
        "kill:rank=0,step=1,signal=-9",
    ],
)
def test_other_negative_values_are_rejected(spec: str) -> None:
    _error(spec)


@pytest.mark.parametrize("hosts", ["0", "0-0", "a-b", "0-", "-1-0", "0_1", "0-1-2", ""])
def test_bad_slow_link_hosts(hosts: str) -> None:
    assert "is not two different host indices like 0-1" in _error(f"slow_link:hosts={hosts},delay=0.1")


def test_bad_bitflip_target() -> None:
    assert "target='weights' is not grad|param" in _error("bitflip:rank=0,step=1,target=weights")


def test_bad_throttle_reason() -> None:
    message = _error("throttle:rank=0,reason=cosmic_rays")
    assert "reason='cosmic_rays'" in message
    for reason in THROTTLE_REASONS:
        assert reason in message


def test_faults_parse_and_specs_round_trip() -> None:
    specs = [spec for spec, _ in FULL.values()]
    faults = Faults.parse(specs)
    assert faults.faults == tuple(f for _, f in FULL.values())
    assert faults.specs() == specs
    assert Faults.parse(faults.specs()) == faults


# -- the chainable set ----------------------------------------------------------------------------------


def test_chaining_returns_new_sets_and_leaves_the_old_one_alone() -> None:
    empty = Faults()
    one = empty.slow(rank=2, from_step=10, delay_s=0.2)
    two = one.exit(rank=3, step=40)
    assert not empty and empty.faults == ()
    assert one.faults == (Slow(rank=2, from_step=10, delay_s=0.2),)
    assert two.faults == (Slow(rank=2, from_step=10, delay_s=0.2), Exit(rank=3, step=40))
    assert one and two
    with pytest.raises(dataclasses.FrozenInstanceError):
        two.faults = ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        two.faults[0].delay_s = 1.0


def test_every_builder_adds_its_fault() -> None:
    f = (
        Faults()
        .slow(rank=2, from_step=10, delay_s=0.2, until_step=30, period=4, burst=2)
        .exit(rank=3, step=40, code=7)
        .kill(rank=1, step=5, signal=15)
        .hang(rank=0, step=12)
        .bitflip(rank=1, step=9, target="param", bit=62, param=3, index=17)
        .skew_rng(rank=2, step=4)
        .skew_data(rank=3, step=6, offset=8)
        .throttle(rank=0, from_step=3, delay_s=0.05, until_step=9, reason="power")
        .bad_device(host=1, index=2, from_step=5, delay_s=0.04, until_step=50, reason="power")
        .slow_link(hosts=(0, 1), from_step=2, delay_s=0.1, until_step=8)
        .nudge(param=2, index=7)
        .gpu_slow(rank=1, from_step=20, factor=1.5, until_step=60)
        .freeze(rank=2, step=30, seconds=4.0)
        .failing_device(host=1, index=0, step=23)
        .device_error(rank=2, step=7)
    )
    assert f.faults == tuple(fault for _, fault in FULL.values())


def test_builders_validate_like_the_parser() -> None:
    with pytest.raises(ValueError, match="rank must be >= 0"):
        Faults().hang(rank=-1, step=0)
    with pytest.raises(ValueError, match="delay must be >= 0"):
        Faults().slow(rank=0, delay_s=-0.5)
    with pytest.raises(ValueError, match="reason 'solar' is not one of"):
        Faults().throttle(rank=0, reason="solar")
    with pytest.raises(ValueError):
        Faults().bitflip(rank=0, step=0, target="weights")
    with pytest.raises(ValueError, match="bit must be in 0..63"):
        Faults().add(BitFlip(rank=0, step=0, bit=99))


def test_validate_rejects_ranks_and_hosts_outside_the_job() -> None:
    ok = Faults().slow(rank=7, delay_s=0.1).exit(rank=0, step=1).slow_link(hosts=(0, 1), delay_s=0.1)
    ok.validate(world_size=8, hosts=2)
    for bad in (Faults().exit(rank=8, step=1), Faults().bitflip(rank=99, step=0)):
        with pytest.raises(ValueError, match=r"rank \d+ does not exist \(ranks are 0\.\.7\)") as info:
            bad.validate(world_size=8, hosts=2)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"host 2 does not exist \(hosts are 0\.\.1\)"):
        Faults().slow_link(hosts=(2, 0), delay_s=0.1).validate(world_size=8, hosts=2)
    with pytest.raises(ValueError, match="host 3 does not exist"):
        Faults().slow_link(hosts=(0, 3), delay_s=0.1).validate(world_size=8, hosts=2)


# -- questions ------------------------------------------------------------------------------------------


def test_compute_delay_respects_from_and_until() -> None:
    f = Faults().slow(rank=2, from_step=10, delay_s=0.2, until_step=13)
    assert [f.compute_delay_s(2, s) for s in range(8, 15)] == [0.0, 0.0, 0.2, 0.2, 0.2, 0.0, 0.0]
    assert f.compute_delay_s(1, 11) == 0.0


def test_compute_delay_open_ended_and_summed() -> None:
    f = Faults().slow(rank=0, delay_s=0.1).slow(rank=0, from_step=5, delay_s=0.25).throttle(rank=0, from_step=7, delay_s=0.5)
    assert f.compute_delay_s(0, 0) == pytest.approx(0.1)
    assert f.compute_delay_s(0, 5) == pytest.approx(0.35)
    assert f.compute_delay_s(0, 10_000) == pytest.approx(0.85)


def test_compute_delay_intermittent_period_and_burst() -> None:
    f = Faults().slow(rank=1, from_step=10, delay_s=1.0, period=5, burst=2, until_step=25)
    active = [s for s in range(0, 30) if f.compute_delay_s(1, s) > 0]
    assert active == [10, 11, 15, 16, 20, 21]
    g = Faults().slow(rank=1, from_step=3, delay_s=1.0, period=4)  # burst defaults to one step
    assert [s for s in range(0, 16) if g.compute_delay_s(1, s) > 0] == [3, 7, 11, 15]


def test_throttle_reason_and_delay() -> None:
    f = Faults().throttle(rank=1, from_step=4, until_step=6, delay_s=0.03, reason="power_brake")
    assert f.throttle_reason(1, 3) is None
    assert f.throttle_reason(1, 4) == ThrottleReason.HW_POWER_BRAKE_SLOWDOWN
    assert f.throttle_reason(1, 5) == ThrottleReason.HW_POWER_BRAKE_SLOWDOWN
    assert f.throttle_reason(1, 6) is None
    assert f.throttle_reason(0, 4) is None
    assert f.compute_delay_s(1, 4) == pytest.approx(0.03)
    assert Faults().throttle(rank=0).throttle_reason(0, 0) == ThrottleReason.HW_THERMAL_SLOWDOWN
    assert THROTTLE_REASONS["sw_thermal"] == ThrottleReason.SW_THERMAL_SLOWDOWN
    assert THROTTLE_REASONS["power"] == ThrottleReason.SW_POWER_CAP


def test_exit_kill_hang_at_their_step_only() -> None:
    f = Faults().exit(rank=3, step=40, code=5).kill(rank=1, step=7).hang(rank=2, step=9)
    assert f.exit_at(3, 40) == Exit(rank=3, step=40, code=5)
    assert f.exit_at(3, 39) is None and f.exit_at(2, 40) is None
    assert f.kill_at(1, 7) == Kill(rank=1, step=7, signal=9)
    assert f.kill_at(1, 8) is None and f.kill_at(3, 7) is None
    assert f.hang_at(2, 9) is True
    assert f.hang_at(2, 10) is False and f.hang_at(1, 9) is False


def test_bitflips_by_target() -> None:
    f = (
        Faults()
        .bitflip(rank=1, step=5, target=FlipTarget.GRAD, bit=3)
        .bitflip(rank=1, step=5, target="param", bit=4)
        .bitflip(rank=1, step=5, bit=5)
        .bitflip(rank=0, step=5, bit=6)
    )
    assert [b.bit for b in f.bitflips(1, 5, FlipTarget.GRAD)] == [3, 5]
    assert [b.bit for b in f.bitflips(1, 5, FlipTarget.PARAM)] == [4]
    assert f.bitflips(1, 6, FlipTarget.GRAD) == []
    assert [b.bit for b in f.bitflips(0, 5, FlipTarget.GRAD)] == [6]


def test_skews_rng_and_data_offset() -> None:
    f = Faults().skew_rng(rank=2, step=4).skew_data(rank=3, step=6, offset=8).skew_data(rank=3, step=6, offset=2)
    assert f.skews_rng(2, 4) is True
    assert f.skews_rng(2, 5) is False and f.skews_rng(3, 4) is False
    assert f.data_offset(3, 6) == 10
    assert f.data_offset(3, 7) == 0 and f.data_offset(2, 6) == 0


def test_link_delay_by_link_name_and_host_names() -> None:
    f = Faults().slow_link(hosts=(1, 0), from_step=2, delay_s=0.1, until_step=5).slow_link(hosts=(2, 3), delay_s=0.4)
    crosses_01 = (link_name("host0", "host1"),)
    assert crosses_01 == ("host0<->host1",)
    assert [f.link_delay_s(crosses_01, s, HOSTS) for s in range(7)] == [0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0]
    assert f.link_delay_s([link_name("host3", "host2")], 0, HOSTS) == pytest.approx(0.4)
    both = [link_name("host1", "host0"), link_name("host2", "host3")]
    assert f.link_delay_s(both, 3, HOSTS) == pytest.approx(0.5)
    assert f.link_delay_s([link_name("host1", "host2")], 3, HOSTS) == 0.0
    assert f.link_delay_s((), 3, HOSTS) == 0.0
    renamed = ["node-b", "node-a", "node-c", "node-d"]  # host indices map through the given names
    assert f.link_delay_s([link_name("node-a", "node-b")], 3, renamed) == pytest.approx(0.1)
    assert f.link_delay_s(crosses_01, 3, renamed) == 0.0


def test_an_empty_set_answers_no() -> None:
    f = Faults()
    assert not f
    assert f.compute_delay_s(0, 0) == 0.0
    assert f.throttle_reason(0, 0) is None
    assert f.exit_at(0, 0) is None and f.kill_at(0, 0) is None and f.hang_at(0, 0) is False
    assert f.bitflips(0, 0, FlipTarget.GRAD) == [] and f.skews_rng(0, 0) is False and f.data_offset(0, 0) == 0
    assert f.link_delay_s(["host0<->host1"], 0, HOSTS) == 0.0
    f.validate(world_size=1, hosts=1)


def test_a_bad_device_throttles_whichever_rank_is_placed_on_it() -> None:
    faults = Faults().bad_device(host=0, index=1, from_step=3, delay_s=0.05).exit(rank=2, step=9)
    on_it = faults.placed(rank=0, host=0, slot=1)
    assert on_it.faults == (Throttle(rank=0, from_step=3, delay_s=0.05), Exit(rank=2, step=9))
    assert on_it.compute_delay_s(0, 3) == 0.05 and on_it.throttle_reason(0, 2) is None
    assert faults.placed(rank=1, host=0, slot=0).faults == (Exit(rank=2, step=9),)
    assert faults.placed(rank=3, host=1, slot=1).faults == (Exit(rank=2, step=9),)


def test_a_failing_device_fails_whichever_rank_is_placed_on_it_and_stays_with_the_machine() -> None:
    faults = Faults().failing_device(host=0, index=1, step=23).exit(rank=2, step=9)
    on_it = faults.placed(rank=0, host=0, slot=1)
    assert on_it.faults == (DeviceError(rank=0, step=23), Exit(rank=2, step=9))
    assert on_it.device_error_at(0, 23) and not on_it.device_error_at(0, 22) and not on_it.device_error_at(1, 23)
    assert faults.placed(rank=1, host=0, slot=0).faults == (Exit(rank=2, step=9),)
    assert faults.hardware().faults == (FailingDevice(host=0, index=1, step=23),)
    with pytest.raises(ValueError, match=r"device slot 2 does not exist"):
        Faults().failing_device(host=0, index=2, step=1).validate(world_size=4, hosts=2)


def test_a_bad_device_must_exist() -> None:
    with pytest.raises(ValueError, match=r"device slot 2 does not exist \(a host has slots 0..1\)"):
        Faults().bad_device(host=0, index=2).validate(world_size=4, hosts=2)
    with pytest.raises(ValueError, match=r"host 2 does not exist"):
        Faults().bad_device(host=2, index=0).validate(world_size=4, hosts=2)


# -- gpu_slow: a device that does more work, not a host that sleeps ----------------------------------------------


@pytest.mark.parametrize("factor", ["0.5", "0", "-2", "101", "nan", "inf"])
def test_gpu_slow_factor_outside_1_to_100_is_rejected(factor: str) -> None:
    message = _error(f"gpu_slow:rank=0,factor={factor}")
    assert "fault gpu_slow: factor must be in 1..100" in message
    with pytest.raises(ValueError, match="factor must be in 1..100"):
        Faults().gpu_slow(rank=0, factor=float(factor))


def test_gpu_slow_bad_and_missing_items() -> None:
    assert "factor='fast' is not a number" in _error("gpu_slow:rank=0,factor=fast")
    assert "missing factor=" in _error("gpu_slow:rank=0,from=3")
    assert "missing rank=" in _error("gpu_slow:factor=2")
    assert "valid keys: rank, from, factor, until" in _error("gpu_slow:rank=0,factor=2,delay=0.1")
    assert "from_step must be >= 0" in _error("gpu_slow:rank=0,factor=2,from=-1")


def test_gpu_slow_rank_must_exist_and_is_not_moved_by_placement() -> None:
    f = Faults().gpu_slow(rank=3, factor=2.0)
    f.validate(world_size=4, hosts=2)
    with pytest.raises(ValueError, match=r"'gpu_slow:rank=3,from=0,factor=2.0': rank 3 does not exist"):
        f.validate(world_size=2, hosts=1)
    assert f.placed(rank=3, host=1, slot=0) == f


def test_device_factor_respects_from_and_until_and_adds_the_extra_parts() -> None:
    f = Faults().gpu_slow(rank=1, from_step=10, factor=1.5, until_step=13).gpu_slow(rank=1, from_step=12, factor=2.0)
    assert [f.device_factor(1, s) for s in range(9, 15)] == [1.0, 1.5, 1.5, 2.5, 2.0, 2.0]
    assert f.device_factor(0, 12) == 1.0
    assert f.slows_device(1) and not f.slows_device(0)
    # a device-side slowdown is no host-side delay, and the host-side one leaves the device alone
    assert f.compute_delay_s(1, 12) == 0.0
    assert Faults().slow(rank=1, delay_s=0.2).device_factor(1, 5) == 1.0
    assert Faults().device_factor(0, 0) == 1.0 and not Faults().slows_device(0)


def test_extra_compute_issues_the_products_of_the_factor_with_the_fraction_carried() -> None:
    extra = ExtraCompute(torch.device("cpu"), own_s=0.010, size=16, matmul_s=0.004)
    assert extra.products_for(1.0) == 0.0 and extra.products_for(0.5) == 0.0
    assert extra.products_for(2.0) == pytest.approx(2.5)
    assert [extra.run(2.0) for _ in range(4)] == [2, 3, 2, 3]
    assert extra.run(1.0) == 0
    with pytest.raises(ValueError, match="must be > 0"):
        ExtraCompute(torch.device("cpu"), own_s=0.0, size=16, matmul_s=0.001)


def test_extra_compute_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ExtraCompute(torch.device("cpu"), own_s=0.01, size=32, matmul_s=0.001).run(3.0)
    assert torch.equal(torch.rand(3), expected)


def test_cpu_fallback_adds_work_proportional_to_the_factor() -> None:
    """The gpu_slow work issues (factor - 1) x own / product products a step, the fraction carried so the mean is
    exact. Counted, not timed: that the products take the time calibrated for them is measured by
    benchmarks/gpu_check.py ("gpu_slow CPU fallback (work)"), not in a unit test on a shared machine."""
    extra = ExtraCompute(torch.device("cpu"), own_s=0.8, size=16, matmul_s=0.1)  # 8 products = one own step
    assert extra.run(1.0) == 0 and extra.run(0.5) == 0
    for factor, per_step in ((1.5, 4.0), (2.0, 8.0), (3.0, 16.0), (1.25, 2.0), (1.1, 0.8)):
        steps = 50
        total = sum(extra.run(factor) for _ in range(steps))
        assert abs(total - per_step * steps) <= 1, (factor, total)
    calibrated = ExtraCompute.calibrate(torch.device("cpu"), lambda: torch.ones(64, 64) @ torch.ones(64, 64))
    assert calibrated.own_s > 0 and calibrated.matmul_s > 0 and 16 <= calibrated.size <= 8192


def test_freeze_parses_round_trips_and_is_validated() -> None:
    f = parse_fault("freeze:rank=1,step=3,seconds=2.5")
    assert f == Freeze(rank=1, step=3, seconds=2.5) and parse_fault(fault_spec(f)) == f
    assert Faults().freeze(rank=1, step=3, seconds=2.5).freeze_s(1, 3) == 2.5
    assert Faults().freeze(rank=1, step=3, seconds=2.5).freeze_s(1, 4) == 0.0
    with pytest.raises(ValueError, match="freeze: seconds"):
        parse_fault("freeze:rank=1,step=3,seconds=0")
    with pytest.raises(ValueError, match="missing seconds="):
        parse_fault("freeze:rank=1,step=3")


def test_hardware_keeps_the_machines_faults_only() -> None:
    faults = (Faults().slow(rank=1, from_step=3, delay_s=0.1).bad_device(host=0, index=1)
              .slow_link(hosts=(0, 1), delay_s=0.01).exit(rank=2, step=5))
    assert [type(f).__name__ for f in faults.hardware().faults] == ["BadDevice", "SlowLink"]
    assert not Faults().exit(rank=0, step=1).hardware()


# -- one syntax: `rankwatch simulate --fault` takes train's spelling ---------------------------------------------------

SIM_RUN_LAYOUT = (4, 2, 2)  # dp, tp, pp: 16 ranks on 4 hosts, rank 13 on the last stage

SHARED_SPECS = (
    "slow:rank=2,from=10,delay=0.03,until=30,period=4,burst=2", "slow:rank=13,delay=0.05",
    "exit:rank=3,step=40", "exit:rank=3,step=40,code=1", "kill:rank=1,step=5,signal=15", "kill:rank=1,step=5",
    "hang:rank=0,step=12", "bitflip:rank=1,step=9,target=param,bit=62,param=3,index=17",
    "skew_rng:rank=2,step=4", "skew_data:rank=3,step=6,offset=8", "skew_data:rank=3,step=6",
    "throttle:rank=0,from=3,delay=0.05,until=9,reason=power", "throttle:rank=14",
    "bad_device:host=1,index=2,from=5,delay=0.04,until=50,reason=power", "bad_device:host=3,index=1",
    "gpu_slow:rank=1,from=20,factor=1.5,until=60", "gpu_slow:rank=0,factor=2",
)
"""Specs of every kind both commands take, with every key given and with defaults, in values the simulator models."""


def _sim_run():  # type: ignore[no-untyped-def]
    from rankwatch.base.topology import Layout
    from rankwatch.simulator.config import SimConfig

    dp, tp, pp = SIM_RUN_LAYOUT
    return SimConfig(layout=Layout(dp=dp, tp=tp, pp=pp), hosts=4, steps=100)


def _train_names(fault: Fault, world: int, hosts: int) -> dict[str, object]:
    """What a train fault does, in the terms both sides share: which rank, when, and how much."""
    from rankwatch.base.topology import Hosts

    if isinstance(fault, BadDevice):  # the rank placed on the slot (no --device-shift): as the trainer places it
        h = Hosts(count=hosts, world_size=world)
        rank = next(r for r in range(world) if h.host_of(r) == f"host{fault.host}" and h.local_rank(r) == fault.index)
        (fault,) = Faults((fault,)).placed(rank=rank, host=fault.host, slot=fault.index).faults
    if isinstance(fault, Slow):
        return {"does": "host stall", "rank": fault.rank, "from": fault.from_step, "until": fault.until_step,
                "period": fault.period, "burst": fault.burst, "delay": fault.delay_s}
    if isinstance(fault, Throttle):
        return {"does": f"throttle {fault.reason}", "rank": fault.rank, "from": fault.from_step,
                "until": fault.until_step, "period": None, "burst": None, "delay": fault.delay_s}
    if isinstance(fault, GpuSlow):
        return {"does": "device factor", "rank": fault.rank, "from": fault.from_step, "until": fault.until_step,
                "period": None, "burst": None, "factor": fault.factor}
    if isinstance(fault, Exit):
        return {"does": "exit", "rank": fault.rank, "step": fault.step, "code": fault.code}
    if isinstance(fault, Kill):
        return {"does": "signal", "rank": fault.rank, "step": fault.step, "signal": fault.signal}
    if isinstance(fault, Hang):
        return {"does": "hang", "rank": fault.rank, "step": fault.step}
    if isinstance(fault, BitFlip):
        return {"does": f"flip {fault.target}", "rank": fault.rank, "step": fault.step}
    if isinstance(fault, SkewRng):
        return {"does": "skew rng", "rank": fault.rank, "step": fault.step}
    assert isinstance(fault, SkewData)
    return {"does": "skew data", "rank": fault.rank, "step": fault.step, "offset": fault.offset}


def _sim_names(fault: object, nominal_s: list[float]) -> dict[str, object]:
    """The same for a simulated fault (its `slow` back in seconds of the rank's nominal compute)."""
    from rankwatch.simulator import faults as sim

    if isinstance(fault, sim.Straggler):
        when = {"rank": fault.rank, "from": fault.from_step, "until": fault.until_step, "period": fault.period,
                "burst": fault.burst}
        if fault.cause is sim.StragglerCause.NONE:
            return {"does": "device factor", **when, "factor": 1 + fault.slow}
        does = {sim.StragglerCause.HOST_STALL: "host stall", sim.StragglerCause.THERMAL: "throttle thermal",
                sim.StragglerCause.POWER: "throttle power"}[fault.cause]
        return {"does": does, **when, "delay": fault.slow * nominal_s[fault.rank]}
    if isinstance(fault, sim.FailStop):
        if fault.how is sim.FailHow.EXIT:
            return {"does": "exit", "rank": fault.rank, "step": fault.step, "code": 1}
        assert fault.how is sim.FailHow.SIGNAL
        return {"does": "signal", "rank": fault.rank, "step": fault.step, "signal": fault.signal}
    if isinstance(fault, sim.Hang):
        return {"does": "hang", "rank": fault.rank, "step": fault.step}
    if isinstance(fault, sim.Corruption):
        assert fault.kind is sim.CorruptionKind.BITFLIP_PARAM
        return {"does": "flip param", "rank": fault.rank, "step": fault.step}
    assert isinstance(fault, sim.Divergence) and len(fault.ranks) == 1
    if fault.field is sim.DivergeField.RNG:
        return {"does": "skew rng", "rank": fault.ranks[0], "step": fault.step}
    return {"does": "skew data", "rank": fault.ranks[0], "step": fault.step, "offset": fault.offset}


def test_simulate_shares_trains_keys_for_every_kind_both_take() -> None:
    from rankwatch.simulator.faults import SHARED_KINDS, SIM_FAULT_KEYS, TRAIN_ONLY_KINDS

    assert {spec.partition(":")[0] for spec in SHARED_SPECS} == set(SHARED_KINDS)
    for kind in SHARED_KINDS:
        assert SIM_FAULT_KEYS[kind] == FAULT_KEYS[FaultKind(kind)], kind
    # every train kind is shared, train-only, or (slow_link) the simulator's own: seconds per collective in train, a
    # factor on the link's transfers in the simulator
    assert set(SHARED_KINDS) | set(TRAIN_ONLY_KINDS) | {"slow_link"} == set(FaultKind)
    assert SIM_FAULT_KEYS["slow_link"] == ("hosts", "from", "factor")


@pytest.mark.parametrize("spec", SHARED_SPECS)
def test_the_same_spec_names_the_same_fault_in_train_and_in_simulate(spec: str) -> None:
    """Rank, step or onset, end, burst pattern and size (a delay in seconds, a factor, a signal, an offset) agree."""
    from rankwatch.simulator.faults import parse_sim_fault
    from rankwatch.simulator.model import _NS, _Topo, _nominal

    cfg = _sim_run()
    nominal_s = [float(x) / _NS for x in _nominal(cfg, _Topo(cfg))]
    train = _train_names(parse_fault(spec), cfg.world_size, cfg.hosts)
    simulated = _sim_names(parse_sim_fault(spec, cfg), nominal_s)
    assert _rounded(simulated) == _rounded(train)


def _rounded(names: dict[str, object]) -> dict[str, object]:
    return {k: round(v, 9) if isinstance(v, float) else v for k, v in names.items()}


def test_a_mistyped_kind_gets_the_nearest_one() -> None:
    assert "unknown fault 'slwo' in 'slwo:rank=1' (did you mean 'slow'?); valid kinds: slow," in _error("slwo:rank=1")
    assert "(did you mean 'bad_device'?)" in _error("bad_devise:host=0,index=1")
    assert "did you mean" not in _error("zzz:rank=1")
