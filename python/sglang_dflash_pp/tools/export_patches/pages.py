"""Each upstream file's page in ``docs/upstream/`` names the commits of the generated series that
change that file: one section per page, ``## In the generated series``, listing those PRs in the
series' order, each with its commit's subject (``git log --grep`` finds it in the series
``export-patches`` writes: the commits exist only where the generator runs, so a page cannot hold
their hashes) and what it does in the file (the edits' own descriptions).

The section is derived from the registry and the stack document, written between markers, and
checked by ``test/srt/test_upstream_docs.py``, so a page never names a commit the series does not
make. A file without a page (one only a bug fix touches) gets a short page of its own.

    python -m sglang_dflash_pp.tools.export_patches.pages --write   # update every page
"""

from __future__ import annotations

import argparse
import functools
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from sglang_dflash_pp.tools.export_patches import stack
from sglang_dflash_pp.tools.export_patches.stack_doc import default_stack_doc, read_stack

BEGIN = "<!-- export-patches series: `python -m sglang_dflash_pp.tools.export_patches.pages --write` -->"
END = "<!-- /export-patches series -->"
DOCS = os.path.dirname(default_stack_doc())  # docs/upstream


def page_of(file: str) -> str:
    """``srt/models/llama.py`` -> ``docs/upstream/srt/models/llama.md``."""
    return os.path.join(DOCS, file[: -len(".py")] + ".md")


@functools.lru_cache(maxsize=1)
def touched_files() -> "OrderedDict[str, List[Tuple[str, List[str]]]]":
    """Upstream file -> [(PR, its edits' descriptions there)], in the series' order; files an
    earlier PR of the series created (our new modules) are not upstream files."""
    rows = _rows()
    created: set = set()
    out: "OrderedDict[str, List[Tuple[str, List[str]]]]" = OrderedDict()
    for n in rows:
        pr = stack.REGISTRY.get(n)
        if pr is None or pr.unfinished:
            break
        per_file: Dict[str, List[str]] = OrderedDict()
        for e in pr.edits:
            if e.file not in created:
                symbol = getattr(e, "symbol", "")
                what = _one_line(e.describe())
                per_file.setdefault(e.file, []).append(f"`{symbol}`: {what}" if symbol else what)
        for file, edits in per_file.items():
            out.setdefault(file, []).append((n, edits))
        created |= {m.file for m in pr.new_modules}
    return out


@functools.lru_cache(maxsize=1)
def _rows():
    """The stack document's rows, read once per process (every page's section needs them)."""
    return read_stack(default_stack_doc())


def _one_line(text: str) -> str:
    return " ".join(text.split())


def section(file: str, prs: Optional[List[Tuple[str, List[str]]]] = None) -> str:
    rows = _rows()
    prs = touched_files()[file] if prs is None else prs
    guide = os.path.relpath(os.path.join(DOCS, "export-patches.md"), os.path.dirname(page_of(file)))
    lines = [
        BEGIN,
        "## In the generated series",
        "",
        f"The commits of `sglang-dflash-pp export-patches` ([export-patches.md]({guide})) that "
        "change this file, in the series' order; in the series it writes, "
        "`git log --grep '^PR <n>:'` finds a PR's commit.",
        "",
    ]
    for n, edits in prs:
        lines.append(f"- **{rows[n].title}**: " + "; ".join(edits) + ".")
    lines.append(END)
    return "\n".join(lines)


def with_section(text: str, file: str) -> str:
    """``text`` (a page) with its series section current: replaced between the markers, or
    appended."""
    new = section(file)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + new + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + new + "\n"


def new_page(file: str) -> str:
    """A page for a file no hook of the plugin changes (test_upstream_docs: every hooked file
    has a page): what the series does there, and the bug report a bug-fix PR fixes."""
    text = f"# `sglang/{file}`\n\nNo hook of the plugin changes this file; only the series does."
    here = os.path.dirname(page_of(file))
    for n, _ in touched_files()[file]:
        bug = stack.REGISTRY[n].bug
        if bug:
            report = os.path.relpath(os.path.join(DOCS, "bugs", bug, "README.md"), here)
            text += f" PR {n} fixes the stock bug of [its report]({report})."
    return text + "\n"


def write() -> List[str]:
    written = []
    for file in touched_files():
        path = page_of(file)
        text = open(path).read() if os.path.exists(path) else new_page(file)
        updated = with_section(text, file)
        if not os.path.exists(path) or updated != text:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(updated)
            written.append(os.path.relpath(path, DOCS))
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="update every page's section")
    args = ap.parse_args(argv)
    if args.write:
        for p in write():
            print("updated", p)
        return 0
    for file, prs in touched_files().items():
        print(os.path.relpath(page_of(file), DOCS), ", ".join(f"PR {n}" for n, _ in prs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
