"""Reading an executed post-mortem notebook in tests (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat

from rankwatch.notebooks.runner import run_postmortem

EPOCH_NS = re.compile(r"\b1[5-9]\d{17}\b")
"""A wall time in ns since the epoch (2017..2033) written as a raw integer: a table a person cannot read."""
GOODPUT = re.compile(r"goodput\W*(?:</td>\s*<td[^>]*>)?\s*([0-9.]+)\s*%", re.IGNORECASE)


@dataclass(frozen=True)
class Report:
    nb: nbformat.NotebookNode
    html: str
    heard: list[str]


def report(run_dir: Path, out: Path) -> Report:
    heard: list[str] = []
    path = run_postmortem(run_dir, out=out / "report.ipynb", html=out / "report.html", progress=heard.append)
    return Report(nb=nbformat.read(path, as_version=4), html=(out / "report.html").read_text(), heard=heard)


def outputs(nb: Any) -> list[Any]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def text(nb: Any) -> str:
    return "\n".join(str(o.get("data", {}).get("text/markdown", "")) + str(o.get("data", {}).get("text/plain", ""))
                     + str(o.get("data", {}).get("text/html", "")) for o in outputs(nb))


def readable_html(html: str) -> None:
    """The HTML report a reader gets: tables as tables, no code, no raw epoch nanoseconds."""
    assert "<table" in html
    # a line of the notebook's code (highlighted, so cut into spans where shown: its first name is enough)
    assert "ensure_views" not in html
    assert not EPOCH_NS.findall(html)
