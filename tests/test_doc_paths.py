"""What the documents (README.md, docs/*.md) point at exists: every repository path they name, every
`python -m` module of this repository, every relative link, and every section another file cites by its
heading (`docs/performance.md`, "Quick start" in a comment finds the heading that begins so)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The directories whose paths the documents name as the repository's own. `data/` is left out: most of
# what the documents name there is written by the commands they show.
SOURCE_DIRECTORIES = ("dew", "native", "tests", "tools", "benchmarks", "examples", "recipes", "docs")
# A path begins at one of them, not inside another path (`~/.cache/dew/jax`) or a dotted name.
PATH = re.compile(rf"(?<![\w./~$@-])((?:{'|'.join(SOURCE_DIRECTORIES)})/[\w./-]*[\w/])")
MODULE = re.compile(r"\bpython3?\s+-m\s+([\w.]+)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# A document and a quoted section of it, as comments, docstrings and documents cite them.
CITATION = re.compile(r"((?:docs/[\w-]+\.md)|README(?:\.md)?)`?,\s+\\?\"([^\"\\]+)\\?\"")
CITING_SUFFIXES = {".py", ".md", ".cc", ".h", ".sh", ".toml"}


def named_paths(text: str) -> set[str]:
    return set(PATH.findall(text))


def headings(document: Path) -> list[str]:
    """The document's headings, outside its code blocks."""
    found, in_code = [], False
    for line in document.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif line.startswith("#") and not in_code:
            found.append(line.lstrip("#").strip())
    return found


def citing_files() -> list[Path]:
    files = [ROOT / "Makefile", ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "setup.py"]
    for directory in SOURCE_DIRECTORIES:
        files += [path for path in (ROOT / directory).rglob("*")
                  if path.suffix in CITING_SUFFIXES and "fixtures" not in path.parts and path.is_file()]
    return files


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d.name)
def test_every_path_a_document_names_exists(document):
    missing = sorted(path for path in named_paths(document.read_text(encoding="utf-8")) if not (ROOT / path).exists())
    assert not missing, f"{document.name} names paths the repository does not hold: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d.name)
def test_every_module_a_document_runs_with_python_m_exists(document):
    missing = []
    for module in MODULE.findall(document.read_text(encoding="utf-8")):
        parts = module.split(".")
        if parts[0] not in SOURCE_DIRECTORIES:
            continue  # another project's module (pip, venv, llama_cpp.server)
        base = ROOT.joinpath(*parts)
        if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
            missing.append(module)
    assert not missing, f"{document.name} runs modules the repository does not hold: {missing}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda d: d.name)
def test_every_relative_link_of_a_document_exists(document):
    links = [link for link in LINK.findall(document.read_text(encoding="utf-8")) if "://" not in link]
    missing = [link for link in links if not (document.parent / link).exists()]
    assert not missing, f"{document.name} links to files the repository does not hold: {missing}"


def test_every_cited_section_is_a_heading_of_its_document():
    wrong = []
    for path in citing_files():
        # A citation may run over a line break, in a comment or a docstring.
        text = re.sub(r"\s*\n\s*(?:#|//)?\s*", " ", path.read_text(encoding="utf-8"))
        for document, section in CITATION.findall(text):
            document = document if document.endswith(".md") else f"{document}.md"
            if not any(heading.startswith(section) for heading in headings(ROOT / document)):
                wrong.append(f"{path.relative_to(ROOT)}: {document}, {section!r}")
    assert not wrong, "sections cited that no heading begins with:\n" + "\n".join(wrong)


def test_the_checks_see_what_they_check(tmp_path):
    text = "(`dew/nn/linear.py`, `tests/interop/`.) Not ~/.cache/dew/jax, $XDG_CACHE_HOME/dew/jax or runs/kjv."
    assert named_paths(text) == {"dew/nn/linear.py", "tests/interop/"}
    assert MODULE.findall("`python -m benchmarks.serve --startup`") == ["benchmarks.serve"]
    assert CITATION.findall('(docs/performance.md, "Quick start")') == [("docs/performance.md", "Quick start")]
    assert CITATION.findall('(README, \\"Images in\\")') == [("README", "Images in")]  # inside a Python string
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n```sh\n# a comment, not a heading\n```\n\n## Quick start\n", encoding="utf-8")
    assert headings(page) == ["Page", "Quick start"]
