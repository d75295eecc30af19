"""The README's and docs' relative links, anchors and named result files all exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "benchmarks" / "results"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    found, seen, in_code = set(), {}, False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def _prose(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_every_result_file_the_docs_name_exists():
    named = {name for page in PAGES
             for name in re.findall(r"\b(?:h200|cpu|smollm2|prefix_cache)_[\w.-]+\.(?:json|jsonl|png|txt|toml)\b",
                                    page.read_text())}
    assert named, "the docs name no result file: the pattern no longer matches them"
    missing = sorted(n for n in named if not (RESULTS / n).exists() and not (ROOT / "docs" / "tuning" / n).exists())
    assert not missing, missing
