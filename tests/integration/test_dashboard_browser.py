"""The HTML report in a real browser: headless Chromium (Debian's `chromium`, installed by .ci/run)
opens the file offline, every chart draws (a plotly root with its rendered svg, and the Gantt chart's
bars), no script or console error, and a screenshot is kept in test-artifacts/ (git-ignored)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_dashboard_data import make_study  # noqa: E402

from autotune.dashboard.data import load_view  # noqa: E402
from autotune.dashboard.report import SECTIONS, write_report  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless, offline: no network services, no first-run work; WebGL (the parallel coordinates)
    through SwiftShader since there is no GPU."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--enable-unsafe-swiftshader", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180)


class ChartScan(HTMLParser):
    """For each chart div (by id): is it a plotly root, does it hold a rendered svg, how many bar
    points did plotly draw in it."""

    def __init__(self, ids: set[str]):
        super().__init__()
        self.ids, self.stack, self.charts = ids, [], {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body = {k: v or "" for k, v in a.items()}
        cid = a.get("id") if tag == "div" and a.get("id") in self.ids else None
        if cid:
            self.charts[cid] = {"plotly": "js-plotly-plot" in (a.get("class") or ""), "svg": 0, "points": 0}
        owner = cid or (self.stack[-1][1] if self.stack else None)
        if tag not in ("br", "img", "input", "meta", "link"):  # void elements never close
            self.stack.append((tag, owner))
        if owner:
            cls = (a.get("class") or "").split()
            if tag == "svg" and "main-svg" in cls:
                self.charts[owner]["svg"] += 1
            if tag == "g" and "point" in cls:
                self.charts[owner]["points"] += 1

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break


def console_errors(stderr: str) -> list[str]:
    """Page console lines that report an error (not Chromium's own GPU/driver chatter)."""
    lines = [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]
    return [ln for ln in lines if re.search(r"Uncaught|Error|error|failed", ln) and "GL Driver Message" not in ln
            and "fallback to software WebGL" not in ln]


def render(tmp_path: Path, name: str, **study_kw) -> tuple[ChartScan, str, Path, dict]:
    url = f"sqlite:///{tmp_path / f'{name}.db'}"
    make_study(url, **study_kw)
    facts = write_report(load_view("s", url), tmp_path / f"{name}.html")
    page = Path(facts["html"]).resolve()
    r = chromium(tmp_path / f"profile-{name}", "--dump-dom", page.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    scan = ChartScan({k for k, _ in SECTIONS})
    scan.feed(r.stdout)
    return scan, r.stderr, page, facts


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium; "
                                             ".ci/run installs it)")
def test_every_chart_draws_without_errors(tmp_path):
    scan, stderr, page, facts = render(tmp_path, "full")
    assert scan.body.get("data-charts-expected") == "6", scan.body
    assert scan.body.get("data-charts-drawn") == "6", scan.body
    assert "data-report-errors" not in scan.body, scan.body.get("data-report-errors")
    assert console_errors(stderr) == []
    for cid, _ in SECTIONS:
        c = scan.charts[cid]
        assert c["plotly"] and c["svg"] >= 1, (cid, c)
    events = len(load_view("s", f"sqlite:///{tmp_path / 'full.db'}").best.breakdown["timeline"])
    assert scan.charts["timeline"]["points"] == events  # one drawn bar per simulated event

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard-report.png"
    shot.unlink(missing_ok=True)
    r = chromium(tmp_path / "profile-shot", "--window-size=1280,4400", f"--screenshot={shot}", page.as_uri())
    assert r.returncode == 0 and shot.exists() and shot.stat().st_size > 50_000, r.stderr[-2000:]
    shutil.copy(page, ARTIFACTS / "dashboard-report.html")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium; "
                                             ".ci/run installs it)")
def test_report_with_nothing_measured_and_no_timeline(tmp_path, monkeypatch):
    """Notes replace the charts that have no data; the rest still draw, with no errors."""
    monkeypatch.setitem(sys.modules, "autotune.cost", None)
    scan, stderr, _, facts = render(tmp_path, "bare", timelines=False, measured=False)
    drawn = facts["charts"]
    assert set(facts["notes"]) == {"accuracy", "timeline", "breakdown"}
    assert scan.body.get("data-charts-drawn") == str(len(drawn)) == scan.body.get("data-charts-expected")
    assert "data-report-errors" not in scan.body and console_errors(stderr) == []
    assert set(scan.charts) == set(drawn)
