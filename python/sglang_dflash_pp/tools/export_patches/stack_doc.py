"""The PR stack as ``docs/upstream/README.md`` states it: order, group, title and description.

Read at run time, so a commit's message is always the docs' current wording of its PR. Each row
of the tables under ``## The PR stack`` is one PR: ``| PR | files | change | tests | risk |``.
The title is the row's change up to its first ``;``, without links; past 72 characters its
parenthetical asides go, then everything after its first ``: `` or ``, ``. The description is the
whole row.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from typing import Dict, List

from sglang_dflash_pp.tools.export_patches.errors import ExportError

SECTION = "## The PR stack"
PR_ID = re.compile(r"^\d+[a-z]?$")
LINK_ASIDE = re.compile(r"\s*\(\[[^\]]*\]\([^)]*\)\)")  # " ([bug](bugs/x/README.md))"
LINK = re.compile(r"\[([^\]]*)\]\(([^)]*)\)")
PAREN = re.compile(r"\s*\([^()]*\)")
TITLE_MAX = 72


@dataclass(frozen=True)
class StackRow:
    pr: str
    group: str  # the ### heading the row sits under
    files: str
    change: str
    tests: str
    risk: str

    @property
    def title(self) -> str:
        return pr_title(self.pr, self.change)

    def description(self, docs_rel: str = "docs/upstream") -> str:
        """The row as a commit body: links become the docs path they point to."""

        def para(label: str, text: str) -> str:
            body = _unlink(text, docs_rel)
            return textwrap.fill(f"{label}{body}", width=72, break_on_hyphens=False)

        return "\n\n".join(
            [
                para("", self.change[:1].upper() + self.change[1:]),
                para("Upstream files: ", self.files),
                para("Tests (in sglang-dflash-pp; they move with the PR): ", self.tests),
                para("Risk: ", self.risk),
            ]
        )


def _unlink(text: str, docs_rel: str) -> str:
    def where(target: str) -> str:
        if "://" in target:
            return target
        return "sglang-dflash-pp " + os.path.normpath(os.path.join(docs_rel, target))

    def aside(m):  # " ([bug](x))" -> " (bug: sglang-dflash-pp docs/upstream/x)"
        inner = m.group(0).strip()[1:-1]
        return " (" + LINK.sub(lambda l: f"{l.group(1)}: {where(l.group(2))}", inner) + ")"

    text = LINK_ASIDE.sub(aside, text)
    return LINK.sub(lambda m: f"{m.group(1)} ({where(m.group(2))})", text)


def pr_title(pr: str, change: str) -> str:
    text = LINK_ASIDE.sub("", change)
    text = LINK.sub(r"\1", text)
    text = text.split("; ")[0].strip()
    if len(text) > TITLE_MAX:
        text = PAREN.sub("", text).strip()
    for sep in (": ", ", "):  # still too long: keep the head clause
        if len(text) > TITLE_MAX and sep in text[20:]:
            text = text[: 20 + text[20:].index(sep)]
    first = text.split(" ")[0]
    if first.replace("-", "").isalpha() and first.islower():
        text = text[:1].upper() + text[1:]
    return f"PR {pr}: {text.replace('`', '')}"


def _cells(line: str) -> List[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_stack(text: str) -> List[StackRow]:
    lines = text.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == SECTION)
    except StopIteration:
        raise ExportError(f"the stack document has no '{SECTION}' section") from None
    rows, group = [], ""
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("### "):
            group = line[4:].strip()
            continue
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if len(cells) == 5 and PR_ID.match(cells[0]):
            rows.append(StackRow(cells[0], group, *cells[1:]))
    if not rows:
        raise ExportError("the stack document lists no PR rows under " + SECTION)
    return rows


def read_stack(path: str) -> Dict[str, StackRow]:
    if not os.path.isfile(path):
        raise ExportError(
            f"no stack document at {path}",
            hint="run from a checkout of sglang-dflash-pp, or pass --stack-doc",
        )
    with open(path) as f:
        rows = parse_stack(f.read())
    return {r.pr: r for r in rows}


def default_stack_doc() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
    return os.path.join(repo, "docs", "upstream", "README.md")
