"""`dflash-eval report`: a self-contained page, escaped text, rendered by real headless Chromium."""
from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest

from eval_worker.results.report import build_report, segments
from eval_worker.results.run_results import ResultsError
from tests.support.eval_results import make_result, write_ledger

REPO = Path(__file__).resolve().parents[3]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture
def run(tmp_path):
    results = tmp_path / "results"
    results_by_step = {}
    for step, p in ((100, 0.3), (200, 0.5), (300, 0.72), (400, 0.6)):
        res = make_result("run-r", step, p=p, baseline_tau=2.0)
        if step == 300:
            res["diagnostics"] = [{"code": "CONTEXT_LEAK_SUSPECTED", "severity": "error",
                                   "message": "τ jumps <img src=x onerror=alert(1)>"}]
        write_ledger(results, res)
        results_by_step[step] = res
    return results, results_by_step


def test_report_is_self_contained_and_escapes_all_text(run, tmp_path):
    results, by_step = run
    path = build_report("run-r", results_dir=results, out_dir=tmp_path / "out")
    html = path.read_text()
    # figures: embedded as PNG data URIs and also written next to the page
    uris = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(uris) == 4
    from PIL import Image

    for b64 in uris:
        w, h = Image.open(io.BytesIO(base64.b64decode(b64))).size
        assert w > 400 and h > 200
    for name in ("tau_vs_step", "per_position", "histogram", "baseline"):
        assert (tmp_path / "out" / f"{name}.png").stat().st_size > 5000
    assert not re.search(r'(src|href)="(https?:)?//', html), "the page must not fetch anything"
    assert "<script" not in html.lower()
    # hostile prompt and diagnostic text appear as text, never as markup
    refs = re.findall(r'<pre class="ref">(.*?)</pre>', html, flags=re.S)
    assert len(refs) == 3 * 4
    texts = {p["reference_text"] for p in by_step[100]["prompts"]}
    assert {unescape(re.sub(r"<span [^>]*>|</span>", "", r)) for r in refs} == texts  # tags are ours only
    assert any("&lt;script&gt;" in r for r in refs)
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<img src=x" not in html
    assert "html &lt;escape&gt; &amp; &#34;quotes&#34;" in html
    # every evaluation in the table, the best one marked; first/best/latest shown in detail
    assert len(re.findall(r"<tr class=\"(best)?\"><td>", html)) == 4
    assert re.search(r'<tr class="best"><td>300</td>', html)
    assert [int(s) for s in re.findall(r'<details(?: open)? id="step-(\d+)"', html)] == [100, 300, 400]
    assert '<details open id="step-300"' in html
    # one highlighted span per verify-step span of every prompt shown
    spans = sum(len(p["accepted_spans"]) for s in (100, 300, 400) for p in by_step[s]["prompts"])
    assert sum(r.count('<span class="s-') for r in refs) == spans


def test_segments_cover_the_text_exactly_once():
    text = "abcdefghij"
    segs = segments(text, [[0, 3], [2, 5], [7, 20], ["x"]], [1, 4, 16], block=16)
    assert "".join(s.text for s in segs) == text
    assert [(s.text, s.css.split()[0] if s.css else "") for s in segs] == [
        ("abc", "s-0"), ("de", "s-2"), ("fg", ""), ("hij", "s-3")]


def test_report_bad_input_is_a_clear_error(run, tmp_path):
    results, _ = run
    with pytest.raises(ResultsError, match=r"no evaluation at step\(s\) \[150\]"):
        build_report("run-r", results_dir=results, out_dir=tmp_path / "o", steps=[150])
    proc = subprocess.run([sys.executable, "-m", "eval_worker.cli", "report", "--run", "ghost", "--results",
                           str(results)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2 and "no results for run 'ghost'" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "eval_worker.cli", "report", "--run", "run-r", "--results",
                           str(results), "--steps", "1,x"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "comma-separated integers" in proc.stderr


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / f"chrome-{len(list(tmp_path.glob('chrome-*')))}"
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args],
                          capture_output=True, text=True, timeout=120)


def _console_errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln and ("Uncaught" in ln or "rror" in ln)]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(run, tmp_path):
    results, _ = run
    url = build_report("run-r", results_dir=results, out_dir=tmp_path / "out").resolve().as_uri()

    # the console check must be able to fail: a page with a JS error is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom')</script></body></html>")
    assert any("boom" in ln for ln in _console_errors(_chromium(tmp_path, "--dump-dom", bad.as_uri()).stderr))

    dom = _chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console_errors(dom.stderr) == []
    assert '<p class="headline" id="best">' in dom.stdout and "<script" not in dom.stdout  # text stayed text

    shot = tmp_path / "shot.png"
    proc = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2400", url)
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert _console_errors(proc.stderr) == []
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 2400)
    colors = img.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 200, "screenshot looks blank"
    # the figures rendered: plenty of the plot's blue in the top part of the page
    top = img.crop((0, 0, 1200, 900))
    blue = sum(n for n, (r, g, b) in top.getcolors(maxcolors=1 << 20) if b > 150 and r < 80 and g < 160)
    assert blue > 500


@pytest.fixture
def two_suites(tmp_path):
    """A run evaluated on two suites, each checkpoint carrying the trainer's metrics (as COMPLETE.json has them)."""
    results = tmp_path / "results"
    train = {}
    for step, p in ((100, 0.3), (200, 0.5), (300, 0.6), (400, 0.65)):
        train[step] = {"loss": round(3.0 - step / 200, 4), "accuracy": round(0.2 + step / 1000, 4),
                       "streak": round(1.5 + step / 200, 4), "window_steps": 50}
        for suite, q in (("coding", p), ("gsm8k-n128", p + 0.1)):
            res = make_result("run-t", step, p=q, baseline_tau=2.0, suite=suite)
            res["checkpoint"]["path"] = "/checkpoints/a-rather-long-directory-name/" * 3 + f"step-{step:08d}"
            write_ledger(results, res, train_metrics=train[step])
    return results, train


def test_report_plots_training_metrics_beside_tau(two_suites, tmp_path):
    from PIL import Image

    results, train = two_suites
    html = build_report("run-t", results_dir=results, out_dir=tmp_path / "out").read_text()
    png = (tmp_path / "out" / "train_vs_eval.png").read_bytes()
    assert f'src="data:image/png;base64,{base64.b64encode(png).decode()}"' in html
    assert Image.open(io.BytesIO(png)).size[1] > 400  # two panels: τ beside train accept length; loss, accuracy
    # every evaluation row shows its checkpoint's training loss and train-side accept length
    evals = re.search(r'<table id="evals">(.*?)</table>', html, flags=re.S).group(1)
    for step, m in train.items():
        rows = re.findall(rf"<tr class=\"(?:best)?\"><td>{step}</td>(.*?)</tr>", evals, flags=re.S)
        assert len(rows) == 2 and all(f"<td>{m['loss']:.3f}</td>" in r and f"<td>{m['streak']:.2f}</td>" in r
                                      for r in rows)
    # the figure is drawn from those metrics: other metrics, another figure
    for res_dir in results.rglob("attempt-0.json"):
        record = json.loads(res_dir.read_text())
        record["job"]["train_metrics"]["loss"] += 1.0
        res_dir.chmod(0o644)
        res_dir.write_text(json.dumps(record))
    build_report("run-t", results_dir=results, out_dir=tmp_path / "out2")
    assert (tmp_path / "out2" / "train_vs_eval.png").read_bytes() != png
    # τ per suite side by side: one row per checkpoint, one column per suite
    table = re.search(r'<table id="suites">(.*?)</table>', html, flags=re.S).group(1)
    assert re.findall(r"<th>([^<]+)</th>", table) == ["step", "coding", "gsm8k-n128"]
    assert len(re.findall(r"<tr><td>\d+</td>", table)) == 4


def test_report_without_training_metrics_says_so(run, tmp_path):
    results, _ = run
    html = build_report("run-r", results_dir=results, out_dir=tmp_path / "out").read_text()
    assert "carries training metrics" in html and not (tmp_path / "out" / "train_vs_eval.png").exists()
    assert '<table id="suites">' not in html  # one suite: nothing to put side by side


MEASURE = """<script>
const wide = [...document.querySelectorAll('table')].map(t => {
  const box = t.closest('.scroll') || t.parentElement, r = box.getBoundingClientRect();
  return {id: t.id, table: t.scrollWidth, box_right: Math.ceil(r.right), box: box.clientWidth,
          scrolls: getComputedStyle(box).overflowX};
});
const out = document.createElement('pre');
out.id = 'measured';
out.textContent = JSON.stringify({page: document.documentElement.scrollWidth, window: window.innerWidth, tables: wide});
document.body.appendChild(out);
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
def test_report_fits_a_1300px_window(two_suites, tmp_path):
    """No horizontal overflow at 1300 px: the page is no wider than the window, and every table
    either fits its box or scrolls inside it."""
    from PIL import Image

    results, _ = two_suites
    page = build_report("run-t", results_dir=results, out_dir=tmp_path / "out")
    probe = page.with_name("measure.html")
    probe.write_text(page.read_text().replace("</body>", MEASURE + "</body>"))  # a copy: the report has no script
    dom = _chromium(tmp_path, "--dump-dom", "--window-size=1300,900", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = json.loads(unescape(re.search(r'<pre id="measured">(.*?)</pre>', dom.stdout, flags=re.S).group(1)))
    assert m["window"] == 1300 and m["page"] <= 1300, m
    assert {t["id"] for t in m["tables"]} == {"suites", "evals"}
    for t in m["tables"]:
        assert t["box_right"] <= 1300, t
        assert t["table"] <= t["box"] or t["scrolls"] in ("auto", "scroll"), t
    evals = next(t for t in m["tables"] if t["id"] == "evals")
    assert evals["table"] <= evals["box"], evals  # the evaluations table fits: no sideways scrolling either

    shot = tmp_path / "shot.png"
    proc = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1300,2400", page.resolve().as_uri())
    assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
    assert Image.open(shot).size == (1300, 2400)
