"""Fault drills: the whole live loop on a real canary, one fault at a time, timed and checked end to end.

    run_drill("sigkill", workdir, say=print) -> DrillReport
    run_drills(["sigkill", "sigstop"], workdir, say=print) -> tuple[DrillReport, ...]

Each drill starts the recovery manager as a service (control.service.ManagerService on 127.0.0.1, port 0, a fresh
webhook secret), which launches a small fast canary (4 gloo ranks, dp=4 over 2 virtual hosts, checkpoints every 10
steps, fingerprints every 10); a `Monitor` (rankwatch.control.monitor) watches the run in a thread and sends its incidents
and decisions to the service as signed webhooks. Then the drill injects one fault — from outside the job where it
can (a signal to the rank's pid, which the service learned from the launcher) — and waits until the job finished,
checking the chain: the detection (class and subject), the decision the service accepted (action, scope), the
recovery record (<run>/recovery/*.json, its gate), the resume, and the final verdict: the recovered run's last
fingerprints bitwise equal to those of a fault-free reference run of the same config (run once per workdir and
cached there), or the lineage's reasons why not (recovery.promises.evaluate).

Drills (DRILLS, in priority order):
    sigkill     SIGKILL of rank 1 (a fail-stop): detected by the liveness records, the job restarted from a checkpoint
    exit        rank 1 calls os._exit(1) inside the job (canary.faults Exit; no outside signal can make a process
                exit with a code of its choosing): a fail-stop, as above
    sigstop     SIGSTOP of rank 1: its liveness thread stops too, so it reads as a rank gone silent (a fail-stop;
                a hang is accepted as well); the service stops the job at once, not after the collective timeout
    straggler   rank 2 sleeps 80 ms more per step (canary.faults Slow): a straggler; the decision is observe, no
                restart, the job finishes
    hang        rank 1's training thread stops in a step while its process (and heartbeat) lives (canary.faults
                Hang): a hang; the job stopped at once and restarted
    bitflip     bit 30 of one gradient element flipped on rank 1 before the all-reduce (canary.faults BitFlip): every
                replica takes the bad update and they still agree; silent corruption, seen in rank 1's local gradient
                norm; rolled back to the checkpoint before the flip (step 19)
    skew_rng    rank 1 draws one extra random number (SkewRng): divergence at the next fingerprint; rolled back to
                step 19, not to the step-29 checkpoint saved between the skew and the fingerprint that showed it
    skew_data   rank 1's data position jumps one sample (SkewData): divergence, as skew_rng
    throttle    rank 2's (replayed) GPU reports a thermal throttle and computes 80 ms longer a step (Throttle): a
                straggler caused by the device; observed (or the device quarantined), no restart
    corrupt_manifest, corrupt_shard
                past the step-29 checkpoint, its manifest is cut in half / one byte of rank 1's state file flipped on
                disk (from outside), then rank 1 is SIGKILLed: the recovery must pass over the damaged checkpoint
                (integrity-checked: CORRUPT) and resume from step 19
    partition   every TCP connection of rank 1's process destroyed from outside (`ss -K`): its process group's
                transport torn down, the process alive; every rank's collective fails at once, rank 1's with its own
                end aborted, its peers' with a reset: fail_stop rank:1 (cause network), restarted
    failing_device
                the (replayed) GPU in slot 1 of host 0 raises a device error at step 23 under whichever rank sits on
                it, in every attempt, its counters healthy: fail_stop rank:1 and a restart; the same again (one rank
                on one device: inconclusive), so the relaunch rotates the ranks over the slots; then rank 0 fails
                on it, the fault follows the device across the attempts (analytics.localize), it is quarantined and
                the last relaunch placed off it
    full_storage
                the step-29 save of rank 1's shard fails with ENOSPC (recovery.checkpoint's save fault, through the
                job's environment, every attempt): nothing is published, training goes on; then rank 1 is SIGKILLed
                and the recovery resumes from step 19, never from the failed save's partial

The canary is paced (CanaryConfig.pace_s) to ~0.2 s a step so that a fault seen from part files is acted on mid-run.
A recovery that undoes a state fault relaunches with a replay basis (the step the fault may have begun at), so the
replayed steps are not compared with the corrupted ones (analytics.replay).

Times are seconds after the fault: to detect (the monitor's first incident naming the subject, on the monitor's
clock), to decision (the service accepted a decision about it), to training again (the first step the new attempt
completed, from its steps). The fault's instant is the signal for sigkill/sigstop and the checkpoint drills, the exit
record's wall clock for exit, the monitor's first sight of the stuck rank's last step for hang, and the monitor's
first sight of the faulty step completed for straggler, throttle, bitflip and the skews.
"""

from rankwatch.canary.drills.report import (
    REPORT_FILE, DrillReport, read_report, report_json, report_table, write_report,
)
from rankwatch.canary.drills.run import reference_fingerprints, run_drill, run_drills
from rankwatch.canary.drills.specs import DRILLS, VICTIM, DrillSpec, Tamper, drill_config

__all__ = ["DRILLS", "REPORT_FILE", "VICTIM", "DrillReport", "DrillSpec", "Tamper", "drill_config", "read_report",
           "reference_fingerprints", "report_json", "report_table", "run_drill", "run_drills", "write_report"]
