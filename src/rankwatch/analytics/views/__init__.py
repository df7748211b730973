"""What people look at: the frames the dashboard and the post-mortem notebook draw, computed by analytics.

An analysis (`analyze(..., config=AnalysisConfig(views=True))`, what `rankwatch analyze` runs) builds the run's views
from the frames it already loaded (`build`) and stores them under `<run>/analysis/views/` (`store`: a reader opens
them in milliseconds, and is told when the telemetry grew since). What is not in the telemetry comes from the run's
own files (`records`: decisions, the lineage, the quarantine list); `panels` arranges both for a reader, and
`progress` reads the increment of a run still being written; `story` says what a reader is told (each incident's
state and next step, a fail-stop from the kill to the replay, times and durations for people). `analytics.analyze.ensure_views` opens a run's views,
analysing it first when none are stored.
"""

from rankwatch.analytics.views.build import (
    FRAME_NAMES, breakdown, build_views, checkpoint_summary, collective_progress, fingerprint_summary, gpu_peers,
    leaderboard, link_summary, progress_frame, rank_steps,
)
from rankwatch.analytics.views.panels import (
    IncidentDetail, across_runs, grid, heatmap, incident_detail, incident_table, observation, run_incidents, timeline,
    topology_status,
)
from rankwatch.analytics.views.progress import LIVE_SKEW_NS, heartbeat_age, live_progress
from rankwatch.analytics.views.records import (
    Comparability, comparability, decisions, lineage, quarantine, recorded_incidents,
)
from rankwatch.analytics.views.story import (
    PENDING, STATES, FailStopStory, Mark, action_text, duration, fail_stop_story, incident_marks, incident_states,
    is_fail_stop, local_time, path_words, readable, readable_text, signal_name, throttle_names,
)
from rankwatch.analytics.views.store import (
    MANIFEST, VIEWS_VERSION, RunViews, ViewStore, ViewSummary, stored_views, telemetry_signature, views_dir,
    write_views,
)

__all__ = [
    "FRAME_NAMES", "LIVE_SKEW_NS", "MANIFEST", "PENDING", "STATES", "VIEWS_VERSION", "Comparability", "FailStopStory",
    "IncidentDetail", "RunViews", "action_text", "duration", "fail_stop_story", "incident_states", "is_fail_stop",
    "local_time", "incident_marks", "Mark", "path_words", "readable", "readable_text", "signal_name", "throttle_names",
    "ViewStore", "ViewSummary", "across_runs", "breakdown", "build_views", "checkpoint_summary", "collective_progress",
    "comparability", "decisions", "fingerprint_summary", "gpu_peers", "grid", "heartbeat_age", "heatmap", "incident_detail",
    "incident_table", "leaderboard", "lineage", "link_summary", "live_progress", "observation", "progress_frame",
    "quarantine", "rank_steps", "recorded_incidents", "run_incidents", "stored_views", "telemetry_signature",
    "timeline", "topology_status", "views_dir", "write_views",
]
