"""The docs point at code by name, never by line number: every [`name`](../file.py) link in README.md and docs/
must land on something the file defines (a function, a class, a constant) or on the step comment it quotes."""

import re

from conftest import ROOT

LINK = re.compile(r"\[`([^`]+)`\]\((?:\.\./)?([\w/]+\.py)(#[^)]*)?\)")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "CONTRIBUTING.md"]


def defines(text: str, name: str) -> bool:
    name = name.removesuffix("()").split(".")[-1]
    if name.isidentifier():
        return re.search(rf"^\s*(def|class) {name}\b|^{name}\s*[:=]", text, re.M) is not None
    return name in text  # a step comment such as `# 3. Generate`


def test_every_code_link_in_the_docs_names_what_the_file_holds_and_no_link_has_a_line_number():
    links = [(doc.name, *m.groups()) for doc in DOCS if doc.exists() for m in LINK.finditer(doc.read_text())]
    assert len(links) > 30
    for doc, name, path, anchor in links:
        assert anchor is None, f"{doc}: `{name}` -> {path}{anchor}: link by name, not by line (lines move)"
        file = ROOT / path
        assert file.exists(), f"{doc}: `{name}` -> {path}: no such file"
        if name in (path, file.name):  # a link to the file itself
            continue
        assert defines(file.read_text(), name), f"{doc}: `{name}` is not defined in {path}"
