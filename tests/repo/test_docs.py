"""The docs site builds and says nothing that points nowhere.

``mkdocs build --strict`` (mkdocs.yml turns every link, anchor and nav check into a warning, and
strict mode fails on one) into a temp folder: no broken link or anchor between pages, no page
missing from the nav or outside it. The README's links into docs/ name pages and anchors that the
built site has, and every repository path the docs and the README name in backticks exists.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Paths in backticks that start with one of these are checked; relative ones (`model/ops.py`, read
# against the folder the text is about) and commands (anything with a space) are not.
TOP = ("services/", "operator/", "tests/", "benchmarks/", "scripts/", "helm/", "proto/", "docs/", ".ci/")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not ours
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))


def test_the_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    assert (site / "architecture" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page() -> None:
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert nav_pages() == pages


def test_the_readme_links_into_pages_and_anchors_the_site_has(site: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)\s]*)\)", readme)
    assert links, "the README links into docs/"
    for link in links:
        page, _, anchor = link.removeprefix("docs/").partition("#")
        if not page.endswith(".md"):
            assert (DOCS / page).is_dir(), link
            continue
        assert (DOCS / page).is_file(), link
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        if anchor:
            assert f'id="{anchor}"' in built.read_text(), f"{link}: no such anchor in the built page"


def inline_code(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fenced blocks hold commands, not names
    return re.findall(r"`([^`\n]+)`", text)


def expand(path: str) -> list[str]:
    """Glob patterns for a named path: ``a.{json,png}`` -> both, ``test_*.py`` as it is. A name with a
    placeholder (``results/gpu-<device>.json``: what a command writes) stands for its folder."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", path)
    if m:
        return [q for alt in m.group(1).split(",") for q in expand(path[: m.start()] + alt + path[m.end() :])]
    if "<" in path:
        return [path[: path.index("<")].rpartition("/")[0] + "/"]
    return [path]


def repository_files() -> list[str]:
    skip = {".git", ".venv", "__pycache__", "build", "site", "node_modules"}
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        out += [Path(folder, f).relative_to(ROOT).as_posix() for f in files]
    return out


def test_paths_named_in_the_docs_exist() -> None:
    """A path from the repository root must exist; a source file named relative to the folder its
    text is about (`openai_api/app.py`, `worker.py`) must end some file's path."""
    files = repository_files()
    missing = []
    for doc in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:
        for code in inline_code(doc.read_text()):
            code = code.rstrip(",.;:")
            if " " in code:
                continue
            if code.startswith(TOP):
                missing += [f"{doc.name}: {p}" for p in expand(code) if not glob.glob(str(ROOT / p))]
            elif re.fullmatch(r"[\w./-]+\.(py|c|proto)", code) and not any(
                f == code or f.endswith("/" + code) for f in files
            ):
                missing.append(f"{doc.name}: {code}")
    assert not missing, "named in the docs, not in the repository:\n" + "\n".join(missing)
