"""A canary run with a rollup agent per virtual host: the run ends rolled up into host parts, every row once, and
analysis reads it as it reads the rank layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analytics.analyze import analyze
from rankwatch.base.schema import Table
from rankwatch.canary.faults import Faults
from rankwatch.collector.rollup import host_dir, list_parts, read_manifest

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 40


def test_a_canary_with_rollup_agents_ends_rolled_up_with_every_row_once(run_dir: Path) -> None:
    cfg = canary(run_dir, layout="dp=2,tp=2,pp=2", hosts=2, steps=STEPS,
                 faults=Faults().slow(rank=5, from_step=15, delay_s=0.05))
    result = run(cfg, rollup_interval_s=0.3)
    assert result.ok, result
    for host in ("host0", "host1"):
        manifest = read_manifest(host_dir(run_dir, Table.STEPS, host))
        assert manifest is not None and len(manifest.ranks) == 4, host
        assert len(manifest.parts) >= 2, host  # rolled up while the job ran, not only at the end
    for table in (Table.STEPS, Table.COLLECTIVES, Table.EVENTS, Table.TOPOLOGY):
        assert list_parts(run_dir, table).rank_parts == (), table  # the final round covered everything
    assert rows(run_dir, "SELECT count(*), count(DISTINCT (rank, step)) FROM steps") == [(8 * STEPS, 8 * STEPS)]
    assert rows(run_dir, "SELECT count(*) FROM (SELECT rank, step, seq, count(*) n FROM collectives "
                         "WHERE status <> 'in_flight' GROUP BY ALL HAVING n > 1)") == [(0,)]
    analysis = analyze(run_dir)
    assert analysis.warnings == ()
    assert [(str(i.klass), i.subject.id) for i in analysis.incidents] == [("straggler", "5")]
