"""rankwatch.notebooks: the post-mortem notebook of a run (`postmortem.py`, jupytext percent format, committed
without outputs) and `run_postmortem`, which executes it on a run and writes the executed notebook (and HTML)."""

from rankwatch.notebooks.runner import NOTEBOOK, run_postmortem

__all__ = ["NOTEBOOK", "run_postmortem"]
