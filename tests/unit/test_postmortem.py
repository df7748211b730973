"""The post-mortem notebook executes on a generated run (figures, the incident, HTML), selects an incident, and a
run that cannot be read is a one-line ValueError with the partial notebook written."""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest
from views_support import analyzed_run


from rankwatch.analytics.analyze import ensure_views
from rankwatch.analytics.incidents import sort_incidents
from rankwatch.notebooks.runner import NOTEBOOK, run_postmortem

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return analyzed_run(tmp_path_factory.mktemp("pm") / "run",
                        faults=("fail_stop:rank=3,step=150", "straggler:rank=9,from=50,slow=0.3"))


def _outputs(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _text(nb) -> str:
    return "\n".join(str(o.get("data", {}).get("text/markdown", "")) + str(o.get("data", {}).get("text/plain", ""))
                     + str(o.get("data", {}).get("text/html", "")) for o in _outputs(nb))


def test_committed_notebook_has_no_outputs_and_a_tagged_parameters_cell():
    nb = jupytext.read(NOTEBOOK, fmt="py:percent")
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and 'run_dir = ""' in tagged[0].source and "incident_id = None" in tagged[0].source


@pytest.mark.slow  # executes the notebook
def test_executes_on_a_run_with_figures_and_html(run: Path, tmp_path: Path):
    heard: list[str] = []
    out = run_postmortem(run, out=tmp_path / "report.ipynb", html=tmp_path / "report.html", progress=heard.append)
    nb = nbformat.read(out, as_version=4)
    code = sum(c.cell_type == "code" for c in nb.cells)
    assert heard[0] == f"starting a kernel for {code} code cells" and len(heard) == code + 1  # a line per cell
    assert heard[-1].startswith(f"cell {code}/{code}: ")
    outs = _outputs(nb)
    assert not [o for o in outs if o.output_type == "error"]
    assert not [o for o in outs if o.output_type == "stream" and o.name == "stderr"]
    assert sum("image/png" in o.get("data", {}) for o in outs) >= 3
    first = sort_incidents(ensure_views(run).incidents)[0]
    assert first.klass == "fail_stop"
    assert f"### `{first.id}` (the most consequential" in _text(nb)
    assert first.id in (tmp_path / "report.html").read_text()


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
