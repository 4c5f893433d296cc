"""The manual stays a manual: every relative link resolves, and size and content budgets hold.

What a reader checks by hand: a link in README.md, examples/README.md or a page under docs/
opens the file it names and, for ``#anchor`` links, the heading it names (GitHub's slugs).
What keeps docs/ a manual rather than a lab notebook: docs/ outside docs/bench/ stays within
150 KB, each backend page within 20 KB, and no page carries dates, issue numbers or commit ids
(run records belong in docs/bench/, history in git and CHANGELOG.md).

Pure Python (standard library only), so it runs without the venv's heavy dependencies.
"""

from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"

#: docs/ outside docs/bench/ (every tracked file, code of the example backend included).
DOCS_BUDGET_BYTES = 150_000
#: one page per backend; each must stay readable in one sitting.
BACKEND_PAGES = ("LOOPBACK.md", "UCX.md", "NIXL.md", "MOONCAKE.md", "MORIIO.md")
BACKEND_PAGE_BUDGET_BYTES = 20_000
#: dated run logs, issue numbers and commit ids belong in git history, not in the manual.
HISTORY = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|[Ii]ssue [0-9]+|commit [0-9a-f]{7}")

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def _repo_files(under: Path) -> list[Path]:
    """Files under ``under`` as git sees them (tracked, or new and not ignored), so build
    output a test install leaves in examples/example_backend is not counted; a plain walk
    outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
             str(under.relative_to(ROOT))],
            cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
        names = [n for n in out.decode().split("\0") if n]
        return sorted(p for p in (ROOT / n for n in names) if p.is_file())
    except (OSError, subprocess.SubprocessError):
        return sorted(p for p in under.rglob("*")
                      if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p))


def _manual_files() -> list[Path]:
    """docs/ outside docs/bench/."""
    return [p for p in _repo_files(DOCS) if BENCH not in p.parents]


def _markdown_files() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "examples" / "README.md"]
    pages += [p for p in _repo_files(DOCS) if p.suffix == ".md"]
    return [p for p in pages if p.is_file()]


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks, inline code removed."""
    in_fence = False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield no, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower-cased, punctuation dropped
    (letters, digits, ``-``, ``_`` and spaces kept), spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links: their text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("*", "").strip().lower()
    kept = "".join(ch for ch in text
                   if ch in "-_ " or unicodedata.category(ch)[0] in ("L", "N"))
    return kept.replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    """Every anchor GitHub makes for ``path`` (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        anchors.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def links_of(path: Path):
    """(line number, target) of every markdown link outside code."""
    for no, line in _prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            yield no, target


def broken_links(path: Path) -> list[str]:
    problems = []
    for no, target in links_of(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(ROOT)}:{no}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors_of(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_docs_outside_bench_within_budget() -> None:
    sizes = {str(p.relative_to(ROOT)): p.stat().st_size for p in _manual_files()}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    assert total <= DOCS_BUDGET_BYTES, (
        f"docs/ outside docs/bench/ is {total} bytes, budget {DOCS_BUDGET_BYTES}; largest: {largest}. "
        "Move run records to docs/bench/ and history to docs/decisions/ or CHANGELOG.md")


@pytest.mark.parametrize("name", BACKEND_PAGES)
def test_each_backend_page_within_budget(name: str) -> None:
    page = DOCS / name
    assert page.is_file(), f"docs/{name}: every backend has one page"
    assert page.stat().st_size <= BACKEND_PAGE_BUDGET_BYTES, (
        f"docs/{name} is {page.stat().st_size} bytes, budget {BACKEND_PAGE_BUDGET_BYTES}")


def test_no_dates_issue_numbers_or_commit_ids_in_the_manual() -> None:
    pages = [p for p in _manual_files() if p.suffix in (".md", ".py", ".toml", ".txt")]
    pages.append(ROOT / "README.md")
    hits = [f"{p.relative_to(ROOT)}:{no}: {line.strip()[:120]}"
            for p in pages
            for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if HISTORY.search(line)]
    assert hits == [], "history belongs in git, CHANGELOG.md or docs/decisions/:\n" + "\n".join(hits)


# The checkers themselves, on made-up pages: each must be able to fail.

def test_slugs_follow_githubs_rules() -> None:
    assert github_slug("Router flow (parallel dispatch), WRITE only") == "router-flow-parallel-dispatch-write-only"
    assert github_slug("6. Device memory: ordering with the forward's stream") == \
        "6-device-memory-ordering-with-the-forwards-stream"
    assert github_slug("The complete example: `example-memmove`") == "the-complete-example-example-memmove"
    assert github_slug("`kv_buffer_device: cpu`") == "kv_buffer_device-cpu"


def test_checker_reports_a_missing_file_and_a_missing_anchor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "B.md").write_text("# Title\n## Same\n## Same\n", encoding="utf-8")
    page = tmp_path / "A.md"
    page.write_text("[ok](B.md#same-1) [ok](#here) [x](C.md) [y](B.md#nope)\n"
                    "```\n[in code](nowhere.md)\n```\n# Here\n`[inline](nowhere.md)`\n", encoding="utf-8")
    problems = broken_links(page)
    assert len(problems) == 2
    assert "C.md does not exist" in problems[0] and "#nope" in problems[1]


def test_history_pattern_catches_what_it_must() -> None:
    for line in ("### 2026-12-05, 07:30 UTC", "see issue 18", "before commit 2eaf1a4"):
        assert HISTORY.search(line)
    assert not HISTORY.search("16 MiB READ over shm: 1.2 ms")
