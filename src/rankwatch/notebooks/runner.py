"""Execute the post-mortem notebook on one run: what `rankwatch postmortem RUN_DIR` calls.

The notebook is committed as a jupytext percent file without outputs (`postmortem.py` beside this module). The
runner reads it, injects the run and the incident as a cell right after the cell tagged `parameters` (tagged
`injected-parameters`, as papermill does), executes it in a fresh `python3` kernel started with this interpreter,
and writes the executed `.ipynb` (and, on request, HTML: the outputs and the notebook's text, without the code). A
run that cannot be analysed or a cell that fails is a one-line `ValueError` naming the run and the cell's error; the
notebook executed up to that cell is still written, so a reader sees where it stopped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

NOTEBOOK = Path(__file__).with_name("postmortem.py")
"""The committed notebook (jupytext percent format, no outputs)."""
PARAMETERS_TAG = "parameters"
INJECTED_TAG = "injected-parameters"
DEFAULT_TIMEOUT_S = 600.0
"""Per cell; the first cell also pays for opening (or analysing) the run."""


def load_notebook(path: Path = NOTEBOOK) -> Any:
    """The notebook as an nbformat node, its kernel set to `python3`. ValueError when it has no cell tagged
    `parameters` (the runner would have nowhere to put the run)."""
    import jupytext

    nb = jupytext.read(path, fmt="py:percent")
    if not any(PARAMETERS_TAG in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise ValueError(f"{path}: no cell tagged {PARAMETERS_TAG!r}")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def inject_parameters(nb: Any, **params: Any) -> Any:
    """Insert a cell assigning `params` (as Python literals) right after the cell tagged `parameters`, replacing a
    previously injected one."""
    import nbformat

    cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    at = next(i for i, c in enumerate(cells) if PARAMETERS_TAG in c.get("metadata", {}).get("tags", []))
    source = "# Parameters\n" + "".join(f"{k} = {v!r}\n" for k, v in params.items())
    cells.insert(at + 1, nbformat.v4.new_code_cell(source, metadata={"tags": [INJECTED_TAG]}))
    nb.cells = cells
    return nb


def _kernel_env() -> dict[str, str]:
    env = dict(os.environ)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    env.pop("PYTHONWARNINGS", None)
    return env


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _failed_cell(nb: Any) -> tuple[int, str]:
    """(index among code cells, 'Ename: evalue') of the first cell with an error output."""
    n = 0
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        n += 1
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                return n, f"{o.get('ename', 'Error')}: {o.get('evalue', '')}"
    return n, "unknown error"


def run_postmortem(run_dir: Path | str, *, out: Path, incident: str | None = None, html: Path | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S, notebook: Path = NOTEBOOK,
                   progress: Callable[[str], None] | None = None) -> Path:
    """Execute the post-mortem notebook on `run_dir` (about `incident`, or the run's most consequential one) and
    write it, executed, to `out` (and as HTML to `html`). Returns `out`. ValueError, one line naming the run, when
    a cell fails (a run that cannot be analysed, an unknown incident id) or times out; `out` then holds the
    notebook executed up to the failing cell. `progress` hears of each code cell as it starts."""
    os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    import zmq
    from traitlets.config import Config

    run = Path(run_dir).resolve()
    out = Path(out)
    nb = inject_parameters(load_notebook(notebook), run_dir=str(run), incident_id=incident)
    out.parent.mkdir(parents=True, exist_ok=True)
    # CurveZMQ keys for the kernel's sockets where the kernel supports them (ipykernel does): no plain-text TCP
    config = Config({"KernelManager": {"transport_encryption": "auto"}} if zmq.has("curve") else {})
    client = NotebookClient(nb, kernel_name="python3", timeout=int(timeout_s), allow_errors=False,
                            record_timing=True, config=config,
                            resources={"metadata": {"path": str(out.parent.resolve())}})
    if progress is not None:
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]

        def started(cell: Any, cell_index: int) -> None:
            if cell_index not in code:  # nbclient calls it for markdown cells too
                return
            n = code.index(cell_index) + 1
            first = next((line.lstrip("# ").strip() for line in str(cell.source).splitlines() if line.strip()), "")
            progress(f"cell {n}/{len(code)}: {first[:70]}")

        client.on_cell_start = started
        progress(f"starting a kernel for {len(code)} code cells")
    failure: str | None = None
    try:
        client.execute(env=_kernel_env())
    except CellExecutionError:
        cell, error = _failed_cell(nb)
        failure = f"stopped in code cell {cell}: {error}"
    except CellTimeoutError:
        failure = f"timed out: a cell ran past {timeout_s:g} s"
    except DeadKernelError as exc:
        failure = f"stopped: the kernel died ({exc})"
    finally:
        nbformat.write(nb, out)
    if failure is not None:
        raise ValueError(_one_line(f"{run}: post-mortem {failure}"))
    if html is not None:
        from nbconvert import HTMLExporter

        # the report for a reader: outputs and the notebook's text, no code and no In/Out prompts (the .ipynb keeps
        # the code)
        exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
        body, _ = exporter.from_notebook_node(nb)
        Path(html).parent.mkdir(parents=True, exist_ok=True)
        Path(html).write_text(body, encoding="utf-8")
    return out
