"""The post-mortem notebook executes on a generated run (figures, every incident, HTML without code and with tables),
selects an incident, and a run that cannot be read is a one-line ValueError with the partial notebook written. (On a
canary run recovered live from a SIGKILL: tests/integration/test_postmortem_kill.py.)"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest
from notebook_support import Report, outputs as _outputs, readable_html as _readable_html, \
    report as _report, text as _text
from views_support import analyzed_run


from rankwatch.analytics.analyze import ensure_views
from rankwatch.analytics.incidents import sort_incidents
from rankwatch.notebooks.runner import NOTEBOOK, run_postmortem

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return analyzed_run(tmp_path_factory.mktemp("pm") / "run",
                        faults=("exit:rank=3,step=150", "gpu_slow:rank=9,from=50,factor=1.3"))


@pytest.fixture(scope="module")
def report(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Report:
    return _report(run, tmp_path_factory.mktemp("pm-report"))


def test_committed_notebook_has_no_outputs_and_a_tagged_parameters_cell():
    nb = jupytext.read(NOTEBOOK, fmt="py:percent")
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and 'run_dir = ""' in tagged[0].source and "incident_id = None" in tagged[0].source
    assert "ensure_views(RUN)" in "".join(c.source for c in nb.cells)  # what the HTML test looks for


@pytest.mark.slow  # executes the notebook
def test_executes_on_a_run_with_figures_and_html(run: Path, report: Report):
    nb = report.nb
    code = sum(c.cell_type == "code" for c in nb.cells)
    assert report.heard[0] == f"starting a kernel for {code} code cells" and len(report.heard) == code + 1
    assert report.heard[-1].startswith(f"cell {code}/{code}: ")
    outs = _outputs(nb)
    assert not [o for o in outs if o.output_type == "error"]
    assert not [o for o in outs if o.output_type == "stream" and o.name == "stderr"]
    assert sum("image/png" in o.get("data", {}) for o in outs) >= 3
    first = sort_incidents(ensure_views(run).incidents)[0]
    assert first.klass == "fail_stop"
    text = _text(nb)
    assert f"### `{first.id}` (the most consequential" in text
    assert first.id in report.html
    _readable_html(report.html)
    # a fail-stop only proposed (a dry run): failed, not recovered, and the plan is pending
    assert "healthy" not in text.lower()
    assert "The run failed and was not recovered" in text and f"`{first.id}` (proposed)" in text
    assert "First to stop: rank 3" in text
    # the dry-run plan was written long after the simulated run: listed, not drawn
    assert "recorded outside the run's time" in text


@pytest.mark.slow  # executes the notebook
def test_every_incident_of_the_run_is_in_the_report(run: Path, report: Report):
    incidents = ensure_views(run).incidents
    assert len(incidents) >= 2
    text = _text(report.nb)
    for i in incidents:
        assert i.id in text and i.id in report.html, i.id
    assert "### Every incident of the run (" in text


@pytest.mark.slow  # executes the notebook
def test_incident_selection(run: Path, tmp_path: Path):
    chosen = next(i for i in ensure_views(run).incidents if i.klass == "straggler")
    nb = nbformat.read(run_postmortem(run, out=tmp_path / "r.ipynb", incident=chosen.id), as_version=4)
    assert not [o for o in _outputs(nb) if o.output_type == "error"]
    assert f"### `{chosen.id}` (chosen)" in _text(nb)


@pytest.mark.slow  # executes the notebook
def test_run_without_telemetry_is_one_line_and_partial_notebook_written(tmp_path: Path):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    with pytest.raises(ValueError) as err:
        run_postmortem(empty, out=tmp_path / "fail.ipynb")
    msg = str(err.value)
    assert "\n" not in msg and str(empty) in msg and "no telemetry" in msg
    nb = nbformat.read(tmp_path / "fail.ipynb", as_version=4)
    assert [o for o in _outputs(nb) if o.output_type == "error"]
