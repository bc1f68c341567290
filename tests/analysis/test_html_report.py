"""``irminsul analyze --html``: the page, rendered in a real headless Chromium, shows every chart.

The browser is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON
messages ending in NUL on file descriptors 3 and 4), so nothing but Debian's ``chromium`` is needed.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from irminsul.analysis.charts import CHARTS
from irminsul.cli import main
from irminsul.traffic.logs import sample_logs

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# What the browser made of the page: per chart, its drawn size and how many shapes it drew
PROBE = """JSON.stringify({
  summaries: Array.from(document.querySelectorAll('p.summary'), p => p.textContent),
  charts: Array.from(document.querySelectorAll('figure.chart'), f => {
    const svg = f.querySelector('svg'); const box = svg ? svg.getBoundingClientRect() : null;
    return {title: f.querySelector('h3').textContent, width: box ? box.width : 0,
            height: box ? box.height : 0,
            shapes: svg ? svg.querySelectorAll('path, rect, use').length : 0}; })})"""


def _onto_3_and_4(read: int, write: int) -> None:
    """In the browser's process, before it starts: the pipe ends on fds 3 and 4, which it reads
    and writes. Copies first, so that neither end is overwritten by the other's move."""
    read, write = os.dup(read), os.dup(write)
    os.dup2(read, 3)
    os.dup2(write, 4)


class Chromium:
    """A headless Chromium driven over the DevTools protocol on a pipe."""

    def __init__(self, profile: Path) -> None:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        self._proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: _onto_3_and_4(to_chrome_r, from_chrome_w))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._ids, self._buffer = 0, b""

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._ids += 1
        message = {"id": self._ids, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self._buffer:
                chunk = os.read(self._from_chrome, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"chromium closed the pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._ids:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, url: str, expression: str, timeout: float = 30.0) -> object:
        """Open ``url``, wait until it has loaded, and return the expression's value."""
        target = self.call("Target.createTarget", url=url)["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        deadline = time.monotonic() + timeout
        # The new target shows about:blank (complete) before it has navigated to the page
        loaded = f"document.readyState === 'complete' && location.href === {json.dumps(url)}"
        while not self.call("Runtime.evaluate", session, expression=loaded,
                            returnByValue=True)["result"]["value"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load in {timeout} s")
            time.sleep(0.1)
        return self.call("Runtime.evaluate", session, expression=expression,
                         returnByValue=True)["result"]["value"]

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except RuntimeError:
            pass
        self._proc.wait(timeout=30)
        os.close(self._to_chrome)
        os.close(self._from_chrome)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (apt-get install "
                    "chromium) to render the page in a real browser")
def test_html_report_renders_every_chart_in_chromium(tmp_path: Path) -> None:
    logs = []
    for k, sample in enumerate(sample_logs()):  # both shipped logs, cut short
        with lzma.open(sample, "rt", encoding="utf-8") as f:
            lines = [next(f) for _ in range(30)]
        logs.append(tmp_path / f"log{k}.jsonl")
        logs[-1].write_text("".join(lines), encoding="utf-8")
    page = tmp_path / "report.html"
    assert main(["-q", "analyze", *map(str, logs), "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    # Self-contained: no script, nothing loaded from elsewhere (links within the page only)
    assert "<script" not in text and not re.findall(r'(?:src|href)="(?!#)', text)
    browser = Chromium(tmp_path / "profile")
    try:
        seen = json.loads(browser.evaluate(page.as_uri(), PROBE))
    finally:
        browser.close()
    titles = [title for title, _ in CHARTS]
    assert [c["title"] for c in seen["charts"]] == titles * len(logs)
    for chart in seen["charts"]:
        assert chart["width"] > 200 and chart["height"] > 50, chart
        assert chart["shapes"] >= 5, chart  # axes, ticks and the data drawn
    assert len(seen["summaries"]) == len(logs)
    for summary in seen["summaries"]:
        assert "An exact-prefix cache serves" in summary and "Irminsul would add" in summary
