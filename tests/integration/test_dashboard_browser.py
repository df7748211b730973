"""The dashboard in a real browser: a canary run on 8 real gloo ranks (a slow rank and a throttled replayed GPU, as
`make demo` runs it, shorter), analysed and given a dry-run recovery plan, and a second run whose rank 2 was SIGKILLed
and recovered live by the recovery manager; `rankwatch dashboard` serves both; Debian's Chromium, driven by Playwright
at 1440 px, opens every page, checks its key elements and reads its text (the fail-stop told from the kill to the
replay, goodput within 100 %, the incidents table's decision column on screen), follows a deep link to the second
run's incident on a fresh server, clicks into the straggler's incident and saves screenshots (into
$RANKWATCH_SCREENSHOTS when set: `docs/screenshots/` holds the committed ones)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankwatch.analytics.analyze import AnalysisConfig, analyze, write_analysis
from rankwatch.canary import Faults
from rankwatch.canary.config import canary_declaration
from rankwatch.canary.launcher import launch
from rankwatch.control.manager import catalog_view, plan_recovery, supervise, write_plan
from rankwatch.dashboard.data import LIVE_ENV
from rankwatch.dashboard.serve import start, stop, wait_ready
from support import canary, run

CHROMIUM = Path("/usr/bin/chromium")
SLOW_RANK = 5
KILLED = 2
WIDTH = 1440
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

if not CHROMIUM.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{CHROMIUM} missing: `make test` installs it (scripts/install_system.sh)")
    pytest.skip(f"{CHROMIUM} missing (scripts/install_system.sh installs Debian's chromium)", allow_module_level=True)

playwright = pytest.importorskip("playwright.sync_api")


def _free_port() -> int:
    from service_support import free_port

    return free_port()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("browser") / "demo"
    faults = Faults().slow(rank=SLOW_RANK, from_step=40, delay_s=0.03).throttle(rank=2, from_step=60, delay_s=0.02)
    cfg = canary(run_dir, layout="dp=2,tp=2,pp=2", steps=120, hosts=2, faults=faults, checkpoint_every=50)
    result = run(cfg, timeout_s=300)
    assert result.ok, result.exit_codes
    analysis = analyze(run_dir, config=AnalysisConfig(views=True))
    write_analysis(analysis)
    assert any(SLOW_RANK in i.ranks for i in analysis.incidents), [str(i.subject) for i in analysis.incidents]
    write_plan(run_dir, plan_recovery(analysis.incidents, job=canary_declaration(cfg.layout),
                                      catalog=catalog_view(run_dir, cfg.layout)))
    return run_dir


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rank 2 SIGKILLed in step 20 and the job recovered live from its last checkpoint (steps 16..19 replayed)."""
    run_dir = tmp_path_factory.mktemp("browser") / "killed"
    cfg = canary(run_dir, layout="dp=4", steps=40, checkpoint_every=8, pg_timeout_s=5.0,
                 faults=Faults().kill(rank=KILLED, step=20))
    out = supervise(cfg, launcher=launch, max_recoveries=1, timeout_s=200, failure_grace_s=3.0, term_grace_s=2.0)
    assert not out.first.ok and out.ok, out.stopped
    return run_dir


def _kill_incident(kill_run: Path) -> str:
    from rankwatch.analytics import views
    from rankwatch.analytics.analyze import ensure_views

    [inc] = [i for i in views.run_incidents(ensure_views(kill_run)) if i.klass == "fail_stop"]
    assert inc.ranks == (KILLED,)
    return inc.id


def _serve(runs: list[Path]) -> Iterator[str]:
    port = _free_port()
    # the run was written seconds ago, which would show Progress live (a refresh every few seconds: the page never
    # settles for a screenshot); the live view is AppTest's (tests/unit/test_dashboard.py)
    before = os.environ.get(LIVE_ENV)
    os.environ[LIVE_ENV] = "0"
    try:
        proc = start(runs, port=port)
    finally:
        if before is None:
            os.environ.pop(LIVE_ENV, None)
        else:
            os.environ[LIVE_ENV] = before
    try:
        wait_ready(port, timeout_s=120, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def server(demo_run: Path, kill_run: Path) -> Iterator[str]:
    yield from _serve([demo_run, kill_run])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as pw:  # one per module: the sync API does not nest
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(server: str, browser: Any) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
    yield page
    page.close()


def _shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("RANKWATCH_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _open(page: Any, url: str, title: str) -> None:
    """Navigate and wait until Streamlit rendered the page: its title is shown, the script run ended, and no
    element is still a loading skeleton; a traceback on the page fails the test."""
    page.goto(url)
    page.get_by_role("heading", name=title).first.wait_for(timeout=90_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidgetRunningIcon\"]')"
                           " && !document.querySelector('[data-testid=\"stSkeleton\"]')", timeout=90_000)
    page.wait_for_timeout(500)  # charts draw after the script run ends
    assert page.locator("[data-testid='stException']").count() == 0, page.locator("[data-testid='stException']").first.inner_text()


# (url path, page title, CSS selectors that must be on the page)
PAGES = [
    ("", "What needs a look", ["[data-testid='stMetric']"]),
    ("progress", "Progress", ["[data-testid='stMetric']", "[data-testid='stDataFrame']"]),
    ("incidents", "Incidents", ["[data-testid='stDataFrame']", "[data-testid='stSelectbox']"]),
    ("heatmap", "Heatmap", ["[data-testid='stVegaLiteChart']"]),
    ("stragglers", "Stragglers", ["[data-testid='stDataFrame']"]),
    ("collectives", "Collectives", ["[data-testid='stMetric']", "[data-testid='stDataFrame']"]),
    ("topology", "Topology", ["[data-testid='stVegaLiteChart']", "[data-testid='stDataFrame']"]),
    ("breakdown", "Time breakdown", ["[data-testid='stVegaLiteChart']"]),
    ("timeline", "Timeline", ["[data-testid='stVegaLiteChart']", "[data-testid='stDataFrame']"]),
    ("runs", "Runs", []),
]


def test_every_page_renders_its_key_elements(page: Any, server: str, tmp_path: Path) -> None:
    shots = _shots(tmp_path)
    for path, title, selectors in PAGES:
        _open(page, f"{server}/{path}", title)
        for sel in selectors:  # charts draw after the script run ends: wait for each, as a reader would
            page.locator(sel).first.wait_for(timeout=60_000)
        page.screenshot(path=str(shots / f"{path or 'overview'}.png"), full_page=True)
        assert (shots / f"{path or 'overview'}.png").stat().st_size > 10_000
    _open(page, server + "/progress", "Progress")
    metrics = page.locator("[data-testid='stMetric']").all_inner_texts()
    assert any("Ranks" in m and "8" in m for m in metrics), metrics


def test_clicking_into_the_straggler_opens_its_evidence(page: Any, server: str, demo_run: Path, tmp_path: Path) -> None:
    from rankwatch.analytics.analyze import ensure_views

    incident = next(i for i in ensure_views(demo_run).incidents if SLOW_RANK in i.ranks)
    _open(page, f"{server}/incidents", "Incidents")
    box = page.locator("[data-testid='stSelectbox']").filter(has_text="Incident").first
    box.click()
    page.get_by_role("option").filter(has_text=incident.id).first.click()
    header = page.get_by_role("heading", name=f"Incident {incident.id}")
    header.wait_for(timeout=60_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidgetRunningIcon\"]')",
                           timeout=60_000)
    page.wait_for_timeout(500)
    body = page.locator("[data-testid='stMain']").inner_text()
    assert incident.summary[:40] in body and "how it was decided" in body.lower(), body[:2000]
    assert f"incident={incident.id}" in page.url
    page.locator("[data-testid='stVegaLiteChart']").first.wait_for(timeout=60_000)  # the subject against its peers
    page.screenshot(path=str(_shots(tmp_path) / "incident.png"), full_page=True)
    # the deep link opens the same detail in a new visit
    _open(page, f"{server}/incidents?incident={incident.id}", "Incidents")
    page.get_by_role("heading", name=f"Incident {incident.id}").wait_for(timeout=60_000)


def test_clicking_a_heatmap_cell_drills_into_its_rank(page: Any, server: str) -> None:
    _open(page, f"{server}/heatmap", "Heatmap")
    main = page.locator("[data-testid='stMain']")
    assert f"Rank {SLOW_RANK}:" in main.inner_text()  # the drill-down starts at the leaderboard's top rank
    chart = page.locator("[data-testid='stVegaLiteChart']").first
    chart.wait_for(timeout=60_000)
    chart.scroll_into_view_if_needed()
    page.wait_for_timeout(1000)  # Vega binds its click handlers once drawn
    box = chart.bounding_box()
    assert box is not None
    # a cell near the top of the chart: one of the first or last two of its 8 rank rows, not the slow rank's
    page.mouse.click(box["x"] + box["width"] * 0.35, box["y"] + box["height"] * 0.12)
    drilled = page.wait_for_function(
        "() => { const m = document.querySelector('[data-testid=\"stMain\"]').innerText.match(/Rank (\\d+):/);"
        " return m !== null && m[1] !== '" + str(SLOW_RANK) + "' ? Number(m[1]) : null; }", timeout=60_000)
    assert drilled.json_value() in set(range(8)) - {SLOW_RANK}


def _main_text(page: Any) -> str:
    return str(page.locator("[data-testid='stMain']").inner_text())


def test_the_kill_run_reads_true_goodput_and_its_fail_stop_story(page: Any, server: str, kill_run: Path,
                                                                 tmp_path: Path) -> None:
    _open(page, f"{server}/progress?run={kill_run.name}", "Progress")
    goodput = next(m for m in page.locator("[data-testid='stMetric']").all_inner_texts() if "Goodput" in m)
    value = float(goodput.split("Goodput")[1].strip().split("%")[0])
    assert 0 < value <= 100, goodput  # wall time counts every attempt, from the first launch
    incident = _kill_incident(kill_run)
    _open(page, f"{server}/?run={kill_run.name}", "What needs a look")
    body = _main_text(page)
    assert "Nothing needs a look now" in body and "recovered" in body, body[:1500]
    _open(page, f"{server}/incidents?run={kill_run.name}&incident={incident}", "Incidents")
    page.get_by_role("heading", name=f"Incident {incident}").wait_for(timeout=60_000)
    body = _main_text(page)
    assert f"First to stop: rank {KILLED}" in body, body[:3000]
    assert "Recovery: recovery-0001: restart the job from step-00000015" in body, body[:3000]
    assert "Replayed: steps 16..19 were trained twice" in body, body[:3000]
    assert "GPU counters" not in body and "Collective arrivals" not in body  # a straggler's sections
    page.screenshot(path=str(_shots(tmp_path) / "incident-fail-stop.png"), full_page=True)


def test_the_incidents_table_fits_1440_px_with_its_decision_column(page: Any, server: str, demo_run: Path) -> None:
    _open(page, f"{server}/incidents?run={demo_run.name}", "Incidents")
    table = page.locator("[data-testid='stDataFrame']").first
    table.wait_for(timeout=60_000)
    headers = page.locator("[data-testid='stDataFrame'] [role='columnheader']").all_inner_texts()
    assert "decision" in headers and "summary" in headers, headers  # glide renders the columns on screen only
    width = page.evaluate("() => { const s = document.querySelector(\"[data-testid='stDataFrame'] .dvn-scroller\");"
                          " return [s.scrollWidth, s.clientWidth]; }")
    assert width[0] <= width[1] + 1, width  # no horizontal scrolling: every column on screen
    box = table.bounding_box()
    assert box is not None and box["x"] + box["width"] <= WIDTH


def test_a_deep_link_to_the_second_runs_incident_lands_on_a_fresh_server(browser: Any, demo_run: Path,
                                                                         kill_run: Path) -> None:
    incident = _kill_incident(kill_run)
    for url in (f"incidents?incident={incident}", f"incidents?run={kill_run.name}&incident={incident}"):
        fresh = _serve([demo_run, kill_run])  # the first visit after the server starts
        base = next(fresh)
        context = browser.new_context(viewport={"width": WIDTH, "height": 1000})  # no cookies, no session
        try:
            page = context.new_page()
            _open(page, f"{base}/{url}", "Incidents")
            page.get_by_role("heading", name=f"Incident {incident}").wait_for(timeout=60_000)
            nav = page.locator("[data-testid='stSidebarNav']").inner_text()
            assert "What needs a look" not in nav and "Overview" in nav and "app" not in nav.split(), nav
            assert f"run={kill_run.name}" in page.url and f"incident={incident}" in page.url, page.url
        finally:
            context.close()
            fresh.close()
