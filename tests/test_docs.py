"""The docs point at code by line: every [`name`](../script.py#LN) link must land on a line that names it."""

import re

from conftest import ROOT

LINK = re.compile(r"\[`([^`]+)`\]\(\.\./([\w/]+\.py)#L(\d+)\)")


def test_every_line_link_in_the_docs_lands_on_what_it_names():
    links = [(doc.name, *m.groups()) for doc in sorted((ROOT / "docs").glob("*.md"))
             for m in LINK.finditer(doc.read_text())]
    assert len(links) > 30
    for doc, name, script, line in links:
        text = (ROOT / script).read_text().splitlines()[int(line) - 1]
        assert name in text, f"{doc}: `{name}` -> {script}#L{line} is now: {text.strip()!r}"
