"""The docs hold together: the README stays a short front door, every relative link (and #anchor) resolves, no scratch
path or git SHA sits in the prose, and the README's Python example runs as written and answers with the task's labels.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 200
MAX_README_WIDTH = 120

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A commit named in prose: a 7-40 character word of hex digits with both a digit and a letter (d4c4a62, 4fba84a).
GIT_SHA = re.compile(r"(?<![\w.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a bash block is not a heading, a link there no link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text of links and code kept, lowercased, punctuation dropped, each space a
    hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path) -> list[str]:
    """The link targets outside code, in order; a link's text may run over a line break."""
    prose = INLINE_CODE.sub("", "\n".join(prose_lines(path.read_text(encoding="utf-8"))))
    targets = [match.group(1) for match in LINK.finditer(prose)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE)]  # http:, mailto: ...


def broken(path: Path, target: str) -> str | None:
    """Why `target`, linked from `path`, does not resolve; None when it does."""
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.name}: {target!r}"
    if not dest.exists():
        return f"{where}: no such file"
    if anchor:
        if dest.suffix != ".md":
            return f"{where}: an anchor into a file that is not markdown"
        if anchor not in anchors(dest):
            return f"{where}: no heading with that anchor in {dest.name}"
    return None


def first_python_block(text: str) -> str:
    match = re.search(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    if match is None:
        raise AssertionError("README.md has no ```python block")
    return match.group(1)


# ---------------------------------------------------------------------------- the checks of the checker


def test_slugs_follow_github():
    assert slug("A tuned head: `tune`, `--head` and the estimator") == "a-tuned-head-tune---head-and-the-estimator"
    assert slug("Long texts: read the first N tokens") == "long-texts-read-the-first-n-tokens"
    assert slug("The int8 cache file's scheme") == "the-int8-cache-files-scheme"
    assert slug("AMD EPYC Zen 3 (AVX2), 100 tickets") == "amd-epyc-zen-3-avx2-100-tickets"


def test_links_and_headings_inside_code_blocks_do_not_count(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\n```bash\n# not a heading\n[x](missing.md)\n```\n\n## Title\n"
                   "See [here](#title-1), `[code](nowhere.md)`, [a long\nlink](#title) and [there](https://example.com).\n",
                   encoding="utf-8")
    assert anchors(doc) == {"title", "title-1"}
    assert relative_links(doc) == ["#title-1", "#title"]
    assert broken(doc, "#title-1") is None
    assert "no heading" in broken(doc, "#not-a-heading")
    assert "no such file" in broken(doc, "missing.md")


def test_a_git_sha_is_found_and_plain_numbers_are_not():
    assert GIT_SHA.search("measured at git d4c4a62, 2026-12-03")
    assert GIT_SHA.search("(4fba84a against e7018fb)")
    assert not GIT_SHA.search("1048576 bytes, 2026-12-05, 57,254 tokens, sha256, e.g. 0x1f")


# ---------------------------------------------------------------------------- the docs


def test_the_readme_is_a_short_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move details into docs/"
    wide = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > MAX_README_WIDTH]
    assert not wide, f"README.md lines over {MAX_README_WIDTH} characters: {wide}"


def test_the_docs_exist():
    names = {path.name for path in DOCS}
    for name in ("usage.md", "accuracy.md", "dtypes.md", "design.md", "benchmarks.md", "jobs.md", "server.md",
                 "ray.md"):
        assert name in names, f"docs/{name} is missing"


def test_every_relative_link_resolves():
    problems = [problem for path in DOCS for target in relative_links(path) if (problem := broken(path, target))]
    assert not problems, "\n".join(problems)
    assert any(relative_links(path) for path in DOCS)  # the parser finds links at all


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_no_scratch_paths_or_git_shas(path):
    text = path.read_text(encoding="utf-8")
    scratch = [line for line in text.splitlines() if "/tmp/" in line]
    assert not scratch, f"{path.name} names scratch paths (use a plain name such as bench-results): {scratch}"
    shas = [f"{m.group()!r} in ...{text[max(0, m.start() - 30):m.end()]}" for m in GIT_SHA.finditer(text)]
    assert not shas, f"{path.name} names commits (give a figure its CPU, date and command instead): {shas}"


def ast_labels(code: str) -> list[str]:
    """The labels the example passes to slimroute.load (its second argument, a list literal)."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "load" and len(node.args) >= 2:
            return list(ast.literal_eval(node.args[1]))
    raise AssertionError("the README's example does not call slimroute.load(model, labels)")


@pytest.mark.slow
def test_the_readme_python_example_runs_and_answers_with_the_labels(tmp_path):
    code = first_python_block(README.read_text(encoding="utf-8"))
    labels = ast_labels(code)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the README's example failed:\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    answers = [line.split()[0] for line in lines if line.split() and line.split()[1].startswith("p=")]
    assert len(answers) == 3 and set(answers) <= set(labels), lines
    probs = [float(line.split()[1].removeprefix("p=")) for line in lines if " p=" in line]
    assert all(0.0 < p <= 1.0 for p in probs), lines
    assert any(line.startswith("dtype: ") for line in lines), lines
    agreement = next(line for line in lines if line.startswith("fast == reference"))
    assert "3/3 labels" in agreement, agreement  # the exactness promise, on the example's own texts
