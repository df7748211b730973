"""Liveness in seconds: every rank of the current attempt classified from ``<run>/live/``, and the fail-stop and hang
incidents that follow, without waiting for part files.

Two channels feed it (docs/liveness.md): each rank's collector rewrites ``rank-<r>.live`` at the end of every completed
step and at least twice per heartbeat interval, from a thread that runs while training is stuck (`collector.liveness`);
the launcher's side of each host writes ``exit-<r>.json`` the moment a rank's process ends. Records carry the rank's
attempt; those of an earlier attempt say nothing of the current one (a relaunch starts a new attempt, and its ranks are
PENDING until they write).

A rank is (`RankState`):

- RUNNING: beating and completing steps (or starting: no step yet, within `startup_grace_s`);
- STUCK: beating, but no step completed for more than `stuck_heartbeats` heartbeats and `stuck_step_factor` recent
  step durations (a checkpoint phase gets `checkpoint_grace_s`); the record says where: the collective (group,
  sequence number) or the phase;
- STOPPED: its process ended abnormally (exit record: exit code or signal), or its collector closed with a non-zero
  code (an exception, SIGTERM);
- LOST: no record change for more than `lost_heartbeats` heartbeats and no exit record: the host is gone or the process
  is frozen (SIGSTOP stops its liveness thread too);
- FINISHED: its collector closed with code 0, or (no collector record) its process exited 0;
- PENDING: no record of the current attempt yet.

Incidents (`classify`), in analytics' vocabulary (`analytics.incidents`):

0. A dead rank whose own connections failed locally while other dead ranks' failed because their peer went
   (`analytics.transport.partitioned`: a partition of that rank) is a FAIL_STOP naming it, cause NETWORK — before
   the job-wide reading below, which every rank dying at once would otherwise give.
1. A STOPPED or LOST rank that was progressing when last heard from and did not die reacting (its exception came from
   a collective, named a peer, or is a survivor's text for a peer gone: "Connection closed by peer", NCCL's
   "remote process exited", a watchdog's timeout — `analytics.transport.is_reaction`), nor was stopped (`_stopped`),
   is a FAIL_STOP naming it. Stopped: asked to stop (its own SIGTERM handler's record, or the launcher's side saw an
   outside signal reach it: `ExitRecord.outside_signal`), or ended with no word of its own after the first such
   request (a SIGKILL at the end of the launcher's grace). torchrun's agent signals every worker still running once
   one has failed (SIGTERM, then SIGKILL after `--shutdown-timeout`), so a request after another rank's failure is
   a reaction to it, and so is every request of a wave reaching more than half the ranks (the job's, once every rank
   is dead). While a rank has not been heard from since the requests began, the requested ranks are not named: it
   may be the one whose end the launcher reacted to. Ranks that died after a culprit while waiting for it, or of the
   error it caused, are survivors, not incidents. When every rank stopped within `job_window_heartbeats` of the
   first, none reacting, it is one FAIL_STOP of the job.
2. When every dead rank reacted, the rank their messages name (one that names no other) is the fail-stop: it is gone
   before its own exit is seen. A rank NCCL prints is the reporter's own (in its group's numbering), never a peer.
3. STUCK ranks (and dead ranks that were stuck when they died) with no fail-stop to wait on are a HANG: the ranks the
   others wait for in their collectives that wait in none themselves (the wait graph's roots), else a minority stuck
   outside any collective while no one waits in one, else, once every rank is stuck, a minority one or more
   completed steps behind all the others (their progress stopped first; on CUDA the others wait at a sync point,
   outside any collective), else the job's (every rank stuck; the summary names the collective).

Onset steps are counted as `analytics.failstop` counts them (the culprit's last completed step + 1; for the job, the
newest last step + 1). Ids are the same at every poll for the same fault (`_live_id`: class, subject, attempt, onset,
ranks, each fixed once the incident holds) and clearly distinct from the part-file detectors' (``<class>-live-...``):
the part-file reading of the same fault cannot be relied on to reach the same onset (the victim's last rows may be lost
with it, and failstop then takes the step its peers wait in, or the record's), so equal ids would hold only by luck.
`same_fault` says when a part-file incident is the fault a liveness incident already named. Evidence and summaries say
they come from liveness.
`LivenessMonitor.poll` also says which incidents of the previous poll are gone (`LivenessView.resolved`), and which of
those were wrong (`LivenessView.withdrawn`: a fail-stop of the current attempt no longer seen — a rank that stopped does
not come back, so a later reading contradicted it).

Clocks: ages compare the monitor's `time.time_ns()` with the writer's. On one machine there is no skew. Across hosts,
NTP keeps it to milliseconds against heartbeats of a second; `LivenessMonitor` also times each record's changes (and
its progress's) on its own clock and takes the younger age (`Seen`), so a writer whose clock runs behind never looks
dead or stuck (one whose clock runs ahead can make a stopped rank look alive longer, never a live one dead).
"""

from rankwatch.analytics.liveness.classify import (
    LIVE_ID_TAG, LivenessConfig, LivenessView, RankLiveness, RankState, Seen, classify, same_fault,
)
from rankwatch.analytics.liveness.monitor import LivenessMonitor
from rankwatch.analytics.liveness.records import (
    ExitRecord, OpenCollective, RankRecord, decode_rank_record, parse_exit_record,
)

__all__ = [
    "ExitRecord", "LivenessConfig", "LivenessMonitor", "LivenessView", "OpenCollective", "RankLiveness", "RankRecord",
    "LIVE_ID_TAG", "RankState", "Seen", "classify", "decode_rank_record", "parse_exit_record", "same_fault",
]
