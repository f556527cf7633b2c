"""The documentation site builds without a warning, and its pages show their figures and commands in a real browser.

`mkdocs build --strict` fails on a broken link, a missing page or an anchor that does not exist. Then the
home page and the measured studies are opened in headless Chromium (Debian's `chromium` package): a screenshot
of each goes to the test's tmp folder, the page's own DOM says whether every figure loaded (each `<img>`'s
`naturalWidth`, read by a short script added to a copy of the page), and the screenshot must hold more than
background where each figure is drawn. The same script measures each block of code and each table: at 1,280 px
(a laptop's browser) none reaches past the window, and one wider than its box scrolls inside it. On the tour's
page (getting-started) every command and table is shown whole: code wraps, the table fits its column, and the
last word of each is drawn in the screenshot. Skipped, with the reason, where mkdocs or Chromium is not
installed (CI's fresh machine has no browser: the build and the sidebar's check still run there).
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


# Added to a copy of a page: where each block of code and each table is drawn, against the box that holds it.
# A table's box is Material's scroll wrapper (added by its script), a code block's is the <code> itself.
LAYOUT_PROBE = """
<script>
window.addEventListener("load", () => {
  const place = (rect) => ({left: rect.left, right: rect.right, top: rect.top + window.scrollY,
                            bottom: rect.bottom + window.scrollY});
  // The last word of an element's text, as drawn: where a cut-off command or row would go missing.
  const lastWord = (element) => {
    const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
    let last = null;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (node.textContent.trim()) last = node;
    }
    const text = last.textContent.trimEnd();
    const range = document.createRange();
    range.setStart(last, text.length - text.trimStart().length);
    range.setEnd(last, text.length);
    return {text: range.toString(), ...place(range.getBoundingClientRect())};
  };
  const blocks = Array.from(document.querySelectorAll("article pre > code, article table")).map((element) => {
    const box = element.tagName === "TABLE" ? element.closest(".md-typeset__scrollwrap") : element;
    const lastCell = element.tagName === "TABLE" ? element.querySelector("tr:last-child > :last-child") : element;
    return {kind: element.tagName.toLowerCase(), text: element.textContent.replace(/\\s+/g, " ").trim().slice(0, 80),
            width: element.scrollWidth, shown: box ? box.clientWidth : null,
            scrolls: box ? ["auto", "scroll"].includes(getComputedStyle(box).overflowX) : false,
            element: place(element.getBoundingClientRect()),
            box: box ? place(box.getBoundingClientRect()) : null, last: lastWord(lastCell),
            // Material's copy button copies a code block's innerText: the lines as written, wrapped or not.
            copies: element.tagName === "CODE" ? element.innerText.trimEnd() === element.textContent.trimEnd() : true};
  });
  const sidebar = document.querySelector(".md-sidebar--primary").innerText.split("\\n").map((l) => l.trim());
  const out = document.createElement("pre");
  out.id = "layout-probe";
  out.textContent = JSON.stringify({window: document.documentElement.clientWidth, blocks, sidebar});
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


def test_the_sidebar_names_each_section_once(site):
    """A section's own index page is its heading's link (navigation.indexes), not a second entry below it."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]
    sections = [
        name
        for entry in nav
        if isinstance(entry, dict)
        for name, value in entry.items()
        if isinstance(value, list)
    ]
    assert sections, "mkdocs.yml's nav has no section"
    page = (site / "getting-started" / "index.html").read_text()
    sidebar = page.split('<nav class="md-nav md-nav--primary"', 1)[1].split("</nav>\n</div>", 1)[0]
    entries = [e.strip() for e in re.findall(r'<span class="md-ellipsis">(.*?)</span>', sidebar, re.S)]
    for name in sections:
        assert entries.count(html.escape(name)) == 1, (
            f"the sidebar lists {name!r} {entries.count(html.escape(name))} times: {entries}"
        )


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
    probe.write_text(page.read_text().replace("</body>", PROBE + LAYOUT_PROBE + "</body>"))

    dump = chromium("--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="figure-probe">(.*?)</pre>', dump.stdout, re.S)
    layout = re.search(r'<pre id="layout-probe">(.*?)</pre>', dump.stdout, re.S)
    assert found and layout, f"the page did not finish loading in the browser:\n{dump.stderr[-3000:]}"
    figures = json.loads(html.unescape(found.group(1)))
    # Its code and tables too (the studies' table of eighteen columns scrolls inside its own box).
    assert_nothing_hidden(page, json.loads(html.unescape(layout.group(1))), whole=False)
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


def assert_nothing_hidden(page: Path, layout: dict, whole: bool) -> list[dict]:
    """Every block of code and every table of the page lies inside the window, in a box of its own. `whole`:
    each is also shown whole (no wider than its box: a wrapped command, a table whose cells wrap); else one
    wider than its box must scroll inside it (a table of eighteen columns)."""
    assert layout["window"] == WINDOW[0]
    article = page.read_text().split("<article", 1)[1]
    blocks = layout["blocks"]
    assert len(blocks) == len(re.findall(r"<pre\b", article)) + len(re.findall(r"<table\b", article)), blocks
    for block in blocks:
        what = f"{block['kind']} {block['text'][:60]!r}"
        box = block["box"]
        assert box is not None, f"{what} has no box of its own to scroll in"
        assert box["left"] >= 0 and box["right"] <= WINDOW[0], (
            f"{what} reaches past the {WINDOW[0]} px window"
        )
        if whole or not block["scrolls"]:
            assert block["width"] <= block["shown"], (
                f"{what} is {block['width']} px in a {block['shown']} px box"
            )
        if whole:
            last = block["last"]
            assert box["left"] <= last["left"] and last["right"] <= box["right"], (
                f"the last word of {what}, {last['text']!r}, is drawn at {last['left']:.0f}-{last['right']:.0f}"
                f" px, outside its box at {box['left']:.0f}-{box['right']:.0f} px"
            )
        assert block["copies"], f"the copy button of {what} would copy other text than the lines it shows"
    return blocks


def test_the_tour_page_shows_every_command_and_table_whole_at_1280_px(site, tmp_path):
    """The setup command, the tour's commands and its table are read whole in a 1,280 px window: code wraps
    inside its box, the table fits its column, and the last word of each is drawn inside the window."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    from PIL import Image, ImageStat

    page = site / "getting-started" / "index.html"
    probe = page.with_name("layout-probe.html")  # beside the page, so that its stylesheets resolve alike
    probe.write_text(page.read_text().replace("</body>", LAYOUT_PROBE + "</body>"))
    dump = chromium("--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="layout-probe">(.*?)</pre>', dump.stdout, re.S)
    assert found, f"the page did not finish loading in the browser:\n{dump.stderr[-3000:]}"
    layout = json.loads(html.unescape(found.group(1)))

    blocks = assert_nothing_hidden(page, layout, whole=True)
    assert any(b["text"].startswith("python3 -m venv") for b in blocks), (
        "the setup command is not on the page"
    )
    assert any(b["kind"] == "table" and "Δ vs best" in b["text"] for b in blocks), (
        "the tour's table is missing"
    )
    assert layout["sidebar"].count("API reference") == 1, layout["sidebar"]

    # The screenshot, to look at (the test's tmp folder); each last word is drawn there: ink, not background.
    shot = tmp_path / "getting-started.png"
    taken = chromium(f"--screenshot={shot}", probe.as_uri())
    assert shot.exists(), taken.stderr[-3000:]
    image = Image.open(shot).convert("L")
    for block in blocks:
        last = block["last"]
        if last["bottom"] > image.size[1]:
            continue  # below the captured window
        word = image.crop(
            (int(last["left"]), int(last["top"]), int(last["right"]) + 1, int(last["bottom"]) + 1)
        )
        assert ImageStat.Stat(word).stddev[0] > 10, f"{last['text']!r} is not drawn in the screenshot {shot}"
