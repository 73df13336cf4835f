"""The README and docs/ stay navigable: small README, the CI's test command, links that resolve, and
every tool listed with what it measures."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Pages written on other branches of the same issue; drop an entry once that branch is merged.
PENDING: set = set()
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def test_readme_is_short_and_keeps_the_ci_test_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 20 * 1024
    assert 'pip install -e ".[test]" && python3 -m pytest -q tests' in readme
    assert "python3 -m pytest -q tests" in (REPO / ".ci" / "run").read_text()


def test_no_page_points_outside_the_repository_for_the_contracts():
    for page in PAGES:
        assert "shared/spec" not in page.read_text(), page.name


def test_local_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if dest in PENDING:
                continue
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_tool_is_listed_with_what_it_measures():
    table = (REPO / "docs" / "benchmarks.md").read_text()
    listed = set(re.findall(r"^\| `tools/([\w.]+)` \| \w", table, flags=re.M))
    tools = {p.name for p in (REPO / "tools").iterdir() if p.is_file() and p.suffix in {".py", ".sh", ".cu"}}
    assert tools == listed


def test_the_plots_are_shown_with_the_command_that_makes_them():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for area in ("forward", "backward", "decode"):
        assert f"(img/{area}.png)" in text
    assert "tools/plot_benchmarks.py" in text and "BENCH=sweep tools/device_check.sh" in text
