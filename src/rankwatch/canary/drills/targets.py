"""What a drill runs on: the canary, or a job rankwatch did not write, known by its command line (`control.command`).

    CANARY                       the drills' canary (`specs.drill_config`), launched by `CanaryLauncher`
    example_target("ddp_gpt")    examples/ddp_gpt.py under `rankwatch torchrun --standalone --nproc-per-node 4`,
                                 saving every 10 steps, fingerprinting every 10, with `--resume`, launched by
                                 `CommandLauncher`; the manager owns it as it owns any command

A drill acts from outside where it can (a signal to a rank's pid, a checkpoint spoiled on disk, a save fault through
the environment); an in-job fault is the job's own: the canary's fault injection (`DrillSpec.faults`), or an
example's fault variables (examples/_faults.py), given to the first attempt only (`CommandJob.faults`): the relaunch
does not inject it again, as an injected fault stands for a transient one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankwatch.analytics.incidents import IncidentClass
from rankwatch.canary.drills.specs import DRILLS, FAULT_AFTER, STEPS, VICTIM, DrillSpec, drill_config
from rankwatch.recovery.job import Job, JobLoader, Launcher

__all__ = ["CANARY", "EXAMPLE_DRILLS", "EXAMPLES", "DrillTarget", "example_target"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DrillTarget:
    name: str
    """"canary" or "example:<name>": the reference run's folder and cache are named by it."""
    what: str
    drills: tuple[str, ...]
    """The drills this job can take (its in-job faults decide which)."""
    job: Callable[[Path, DrillSpec | None], Job]
    """The job of a drill (None: the fault-free reference) in a run directory."""
    launcher: Callable[[], Launcher]
    load_job: JobLoader
    launch_kw: Mapping[str, Any] = field(default_factory=dict)
    steps: int = STEPS
    compared: tuple[str, ...] = ("param_hash", "optim_hash", "rng_python_hash", "rng_numpy_hash", "rng_torch_hash",
                                 "data_position")
    """The fingerprint fields the final state is compared on with the reference run's: the state the job's
    trajectory is made of. A random stream the job never seeds (Python's and numpy's in the examples: seeded from
    the OS in every process) differs between any two runs and is left out."""
    faults: Mapping[str, str] = field(default_factory=dict)
    """What a drill injects where this job's fault differs from the canary's (`what`)."""

    classes: Mapping[str, tuple[IncidentClass, ...]] = field(default_factory=dict)
    """The classes a drill may be detected as on this job where they differ from the canary's
    (`DrillSpec.classes`)."""

    unpinned: frozenset[str] = frozenset()
    """Drills whose relaunch may resume from any sound checkpoint on this job, not the one the canary's pacing
    leaves (`DrillSpec.resume_from`); the final state is still compared bitwise."""

    def fault_of(self, name: str) -> str:
        return self.faults.get(name) or DRILLS[name].what


def _canary_job(run_dir: Path, spec: DrillSpec | None) -> Job:
    if spec is None:
        return drill_config(run_dir)
    return drill_config(run_dir, spec.faults, slots_per_host=spec.slots_per_host)


def _canary_launcher() -> Launcher:
    from rankwatch.canary.launcher import CanaryLauncher

    return CanaryLauncher()


def _canary_loader(run_dir: Path) -> Job:
    from rankwatch.canary.config import config_from_run

    return config_from_run(run_dir)


CANARY = DrillTarget(name="canary", what="the canary (4 gloo ranks, dp=4 over 2 virtual hosts)", drills=tuple(DRILLS),
                     job=_canary_job, launcher=_canary_launcher, load_job=_canary_loader,
                     # a long failure grace (and the canary's 30 s collective timeout): only the service's stop
                     # ends an attempt fast
                     launch_kw={"timeout_s": 240.0, "failure_grace_s": 60.0, "term_grace_s": 2.0})


EXAMPLES = {"ddp_gpt": "", "fsdp2_transformer": "", "fsdp_tp_2d": "dp=2,tp=2"}
"""The examples under examples/ and the layout each declares ("": data parallel over the world)."""

EXAMPLE_FAULTS: dict[str, tuple[tuple[str, str], ...]] = {
    "exit": (("FAULT_RAISE_RANK", str(VICTIM)), ("FAULT_RAISE_STEP", str(FAULT_AFTER + 1))),
    "straggler": (("FAULT_SLEEP_RANK", "2"), ("FAULT_SLEEP_MS", "80"), ("FAULT_SLEEP_STEP", str(FAULT_AFTER + 1))),
    "skew_rng": (("FAULT_RNG_SKEW_RANK", str(VICTIM)), ("FAULT_RNG_SKEW_STEP", str(FAULT_AFTER + 1))),
    "bitflip": (("FAULT_BITFLIP_RANK", str(VICTIM)), ("FAULT_BITFLIP_STEP", str(FAULT_AFTER + 1))),
    "hang": (("FAULT_HANG_RANK", str(VICTIM)), ("FAULT_HANG_STEP", str(FAULT_AFTER + 1))),
    "skew_data": (("FAULT_DATA_SKEW_RANK", str(VICTIM)), ("FAULT_DATA_SKEW_STEP", str(FAULT_AFTER + 1))),
}
"""The drills whose fault is inside the job, as the examples' own fault variables (examples/_faults.py): rank 1
raises at step 23 (its exit a fail-stop), rank 2 sleeps 80 ms a step from step 23 (from the start, the monitor
could name it before the drill's clock started: a race a drill lost once), rank 1 draws one extra
random number at step 23, rank 1 flips a gradient bit before its step-23 optimizer step, rank 1 stops making progress
in step 23 (its collector beating on), rank 1's data stream skips a batch at step 23."""

EXAMPLE_MACHINE_FAULTS: dict[str, tuple[tuple[str, str], ...]] = {
    "failing_device": (("FAULT_DEVICE", str(VICTIM)), ("FAULT_DEVICE_STEP", str(FAULT_AFTER + 1))),
}
"""The drills whose fault belongs to the machine, not to one attempt: in the job's environment at every attempt
(`CommandJob.env`), met by whichever rank the launcher places on the device (examples/_faults.py)."""

WORLD = 4
"""The examples' ranks in a drill (torchrun --nproc-per-node)."""

EXAMPLE_DRILLS = ("sigkill", "exit", "sigstop", "hang", "straggler", "bitflip", "skew_rng", "skew_data",
                  "corrupt_manifest", "corrupt_shard", "failing_device", "full_storage")
"""The drills an example takes: those from outside the job, and those its fault variables inject."""

_EXAMPLE_ARGS = ("--steps", str(STEPS), "--save-every", "10", "--fingerprint-every", "10", "--resume")


def example_target(example: str | Path) -> DrillTarget:
    """The drills' target for an example (a name under examples/, or a path to one of them). ValueError naming the
    examples when it is none of them or the script is not there."""
    path = Path(example)
    name = path.stem if path.suffix == ".py" else str(example)
    if name not in EXAMPLES:
        raise ValueError(f"no drills for example {str(example)!r} (examples: {', '.join(EXAMPLES)})")
    script = path if path.suffix == ".py" else Path("examples") / f"{name}.py"
    if not script.is_file():
        raise ValueError(f"{script}: no such example script (run from the repository root, or give its path)")
    script = script.resolve()

    def job(run_dir: Path, spec: DrillSpec | None) -> Job:
        from rankwatch.base.topology import Layout
        from rankwatch.control.command import CommandJob

        extra = ("--tp", "2") if name == "fsdp_tp_2d" else ()
        command = [sys.executable, "-m", "rankwatch.cli", "torchrun", "--standalone", "--nproc-per-node", str(WORLD),
                   str(script), *_EXAMPLE_ARGS, *extra]
        layout = Layout.parse(EXAMPLES[name]) if EXAMPLES[name] else None
        env = {"OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
        env.update(EXAMPLE_MACHINE_FAULTS.get(spec.name, ()) if spec is not None else ())
        # a drill that needs spare devices places the job on a visibility list with two more than its ranks
        devices = [str(d) for d in range(WORLD + 2)] if spec is not None and spec.slots_per_host else None
        cmd = CommandJob.from_args(run_dir, command, layout=layout, cwd=script.parent.parent, env=env,
                                   devices=devices or ())
        faults = EXAMPLE_FAULTS.get(spec.name, ()) if spec is not None else ()
        from dataclasses import replace

        return replace(cmd, faults=faults)

    def launcher() -> Launcher:
        from rankwatch.control.command import CommandLauncher

        return CommandLauncher(term_grace_s=5.0)

    def load(run_dir: Path) -> Job:
        from rankwatch.control.command import CommandJob

        return CommandJob.from_run(run_dir)

    return DrillTarget(name=f"example:{name}", what=f"examples/{name}.py (4 gloo ranks under rankwatch torchrun)",
                       drills=EXAMPLE_DRILLS, job=job, launcher=launcher, load_job=load,
                       launch_kw={"timeout_s": 240.0},
                       faults={"exit": f"rank {VICTIM} raises RuntimeError at step {FAULT_AFTER + 1} (FAULT_RAISE_*)",
                               "straggler": f"rank 2 sleeps 80 ms in every step from step {FAULT_AFTER + 1} (FAULT_SLEEP_*)",
                               "skew_rng": f"rank {VICTIM} draws one extra torch.rand at step {FAULT_AFTER + 1} "
                                           "(FAULT_RNG_SKEW_*)",
                               "failing_device": f"device {VICTIM} of the job's visibility list (0-5, two spares) "
                                                 f"raises a CUDA ECC error at step {FAULT_AFTER + 1} under whichever "
                                                 "rank is placed on it, every attempt (FAULT_DEVICE*)",
                               "hang": f"rank {VICTIM} stops making progress in step {FAULT_AFTER + 1}, its collector "
                                       "beating on (FAULT_HANG_*)",
                               "skew_data": f"rank {VICTIM}'s data stream skips one batch at step {FAULT_AFTER + 1} "
                                            "(FAULT_DATA_SKEW_*)",
                               "bitflip": f"bit 30 of the first gradient element rank {VICTIM} holds flipped after "
                                          f"the backward of step {FAULT_AFTER + 1}, before its optimizer step "
                                          "(FAULT_BITFLIP_*)"},
                       compared=("param_hash", "optim_hash", "rng_torch_hash", "data_position"),
                       # the canary flips its bit before its own all-reduce (a gradient-norm outlier); here the flip
                       # comes after DDP's all-reduce, on one rank: that replica applies another update, parameters
                       # and optimizer state departing together, which the fingerprints read as its divergence
                       # (`analytics.divergence.state_departures`)
                       classes={"bitflip": (IncidentClass.DIVERGENCE, IncidentClass.CORRUPTION)})
