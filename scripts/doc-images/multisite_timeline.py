"""Draws docs/images/multisite-timeline.png: a small three-site workflow (hpc, cloud, here — all
the local executor, each its own store root) run with `phalanx run`, its report written with
`phalanx report RUN --state ...`, and the report's timeline shot in headless chromium.

    PYTHONPATH=tests .venv/bin/python scripts/doc-images/multisite_timeline.py [OUT.png]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITES = {"hpc": 2, "cloud": 3, "here": 1}
WORKFLOW = """\
name: etl-across
site: hpc
stages:
  generate: {app: "apps:wf_generate", ranks: 2, params: {rows: 300000, seed: 9}, outputs: [tx]}
  profile: {app: "apps:wf_say", ranks: 2, inputs: {tx: {dataset: tx}}, outputs: [profiled]}
  totals:
    app: "apps:wf_totals"
    ranks: 3
    site: cloud
    inputs: {tx: {dataset: tx, by: [user]}}
    outputs: [totals]
  summary:
    app: "apps:wf_say"
    ranks: 1
    site: here
    inputs: {tx: {dataset: totals}}
    outputs: [summary]
"""


def phalanx(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    out = subprocess.run([sys.executable, "-m", "phalanx.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"phalanx {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


def shoot(html: Path, png: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    opts = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1200,1400",
        "--force-device-scale-factor=2",
    ):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        browser.get(html.as_uri())
        found = browser.find_elements(By.CSS_SELECTOR, "svg")
        if not found:
            raise SystemExit(f"{html}: no timeline (svg) in the report")
        # the report's largest drawing is the timeline (lane groups per site)
        max(found, key=lambda e: e.size["width"] * e.size["height"]).screenshot(str(png))
    finally:
        browser.quit()


def main() -> None:
    png = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/images/multisite-timeline.png"
    with tempfile.TemporaryDirectory(prefix="px-multisite-") as tmp:
        d = Path(tmp)
        (d / "site-configs").mkdir()
        for name, cores in SITES.items():
            (d / "site-configs" / f"{name}.yaml").write_text(
                f"name: {name}\ncores: {cores}\nstore: {{root: {d}/{name}-store}}\n"
            )
        (d / "wf.yaml").write_text(textwrap.dedent(WORKFLOW))
        print(phalanx("validate", "wf.yaml", cwd=d))
        ran = phalanx("run", "wf.yaml", "--plain", "--state", str(d / "state"), cwd=d)
        print(ran)
        found = re.search(r"^run (\S+) succeeded", ran, re.MULTILINE)
        if not found:
            raise SystemExit("the run did not succeed")
        phalanx("report", found.group(1), "--state", str(d / "state"), "-o", str(d / "report.html"), cwd=d)
        png.parent.mkdir(parents=True, exist_ok=True)
        shoot(d / "report.html", png)
    print(f"{png}: {png.stat().st_size} bytes")


if __name__ == "__main__":
    main()
