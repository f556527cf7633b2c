"""The documentation site builds without a warning, and its pages show their figures in a real browser.

`mkdocs build --strict` fails on a broken link, a missing page or an anchor that does not exist. Then the
home page and the measured studies are opened in headless Chromium (Debian's `chromium` package): a screenshot
of each goes to the test's tmp folder, the page's own DOM says whether every figure loaded (each `<img>`'s
`naturalWidth`, read by a short script added to a copy of the page), and the screenshot must hold more than
background where each figure is drawn. Skipped, with the reason, where mkdocs or Chromium is not installed.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.docs

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p is not None), None
)
WINDOW = (1280, 6000)  # tall enough for the home page and the first figures of the studies page
PAGES = {"home": "index.html", "studies": "studies/index.html"}

# Added to a copy of a page: once everything has loaded, write what each figure became into the DOM.
PROBE = """
<script>
window.addEventListener("load", () => {
  const figures = Array.from(document.querySelectorAll("article img")).map((img) => {
    const box = img.getBoundingClientRect();
    return {src: img.getAttribute("src"), complete: img.complete, width: img.naturalWidth,
            height: img.naturalHeight, x: box.left + window.scrollX, y: box.top + window.scrollY,
            w: box.width, h: box.height};
  });
  const out = document.createElement("pre");
  out.id = "figure-probe";
  out.textContent = JSON.stringify(figures);
  document.body.appendChild(out);
});
</script>
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[dev]')")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("site") / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            "mkdocs.yml",
            "--site-dir",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"mkdocs build --strict failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return out


def test_every_page_of_the_nav_is_built(site):
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python tags; the nav needs none of them
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)

    def flatten(entries) -> list[str]:
        out = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            out += flatten(value) if isinstance(value, list) else [value]
        return out

    pages = flatten(config["nav"])
    for page in pages:
        assert (ROOT / "docs" / page).exists(), page
        stem = page.removesuffix(".md")
        built = site / (
            f"{stem.removesuffix('index')}index.html" if stem.endswith("index") else f"{stem}/index.html"
        )
        assert built.exists(), f"{page} was not built"
    listed = set(pages)
    unlisted = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").glob("*.md")}
    unlisted |= {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs" / "reference").glob("*.md")}
    unlisted -= listed
    assert not unlisted, f"pages in docs/ that the nav leaves out: {sorted(unlisted)}"


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # root in a container has no user namespace to sandbox with
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--allow-file-access-from-files",
            f"--window-size={WINDOW[0]},{WINDOW[1]}",
            "--virtual-time-budget=10000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("name", sorted(PAGES))
def test_a_page_shows_its_figures_in_a_browser(site, tmp_path, name):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from PIL import Image, ImageStat

    page = site / PAGES[name]
    probe = page.with_name("probe.html")  # beside the page, so that its relative links resolve alike
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))

    dump = chromium("--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="figure-probe">(.*?)</pre>', dump.stdout, re.S)
    assert found, f"the page did not finish loading in the browser:\n{dump.stderr[-3000:]}"
    figures = json.loads(html.unescape(found.group(1)))
    expected = len(re.findall(r"<img\b", page.read_text().split("<article", 1)[1]))
    assert figures and len(figures) == expected, (figures, expected)
    broken = [f["src"] for f in figures if not (f["complete"] and f["width"] > 0 and f["height"] > 0)]
    assert not broken, f"figures that did not load on {PAGES[name]}: {broken}"

    shot = tmp_path / f"{name}.png"
    taken = chromium(f"--screenshot={shot}", probe.as_uri())
    assert shot.exists(), taken.stderr[-3000:]
    image = Image.open(shot).convert("L")
    assert image.size == WINDOW
    shown = 0
    for figure in figures:
        box = (
            int(figure["x"]),
            int(figure["y"]),
            int(figure["x"] + figure["w"]),
            int(figure["y"] + figure["h"]),
        )
        if box[3] > image.size[1] or figure["w"] < 50:
            continue  # below the captured window
        region = image.crop(box)
        # A figure is lines and text on white: its pixels spread far more than a blank (or missing) image's.
        assert ImageStat.Stat(region).stddev[0] > 10, f"{figure['src']} is blank in the screenshot {shot}"
        shown += 1
    assert shown >= 1, f"no figure of {PAGES[name]} lies in the captured {WINDOW} window"
