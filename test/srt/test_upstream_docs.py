"""``docs/upstream/`` cannot drift from the plugin: every hook we register is named on the page of
the upstream file it changes, every link resolves, and every test file the pages name exists.

The hook list is the plugin's own (``plugin.plugin_hooks()``, the list ``register()`` hands to
sglang), so a hook added without a docs page fails here.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs", "upstream")
SGLANG_ROOT = importlib.util.find_spec("sglang").submodule_search_locations[0]


def upstream_file_and_symbol(target: str):
    """``sglang.srt.a.b.Cls.meth`` -> (``srt/a/b.py``, ``Cls.meth``), found on the installed wheel."""
    parts = target.split(".")
    assert parts[0] == "sglang", target
    for i in range(len(parts) - 1, 1, -1):
        rel = os.path.join(*parts[1:i]) + ".py"
        if os.path.isfile(os.path.join(SGLANG_ROOT, rel)):
            return rel, ".".join(parts[i:])
    raise AssertionError(f"no module of sglang 0.5.23 holds {target}")


def page_for(upstream_rel: str) -> str:
    return os.path.join(DOCS, upstream_rel[: -len(".py")] + ".md")


def markdown_files():
    for d, _, files in os.walk(DOCS):
        for f in files:
            if f.endswith(".md"):
                yield os.path.join(d, f)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def plugin_hooks():
    from sglang_dflash_pp.plugin import plugin_hooks as hooks

    return hooks()


def test_every_registered_hook_is_named_on_its_upstream_file_page():
    missing = []
    for h in plugin_hooks():
        rel, symbol = upstream_file_and_symbol(h.target)
        page = page_for(rel)
        if not os.path.isfile(page):
            missing.append(f"{h.name}: no page {os.path.relpath(page, REPO)}")
            continue
        text = read(page)
        row = [l for l in text.splitlines() if f"`{symbol}`" in l or f"`{symbol}` (" in l]
        if not any(h.hook_type.upper() in l for l in row):
            missing.append(
                f"{h.name}: {os.path.relpath(page, REPO)} has no line naming `{symbol}` "
                f"with its hook type {h.hook_type.upper()}"
            )
    assert not missing, "docs/upstream does not cover:\n" + "\n".join(missing)


def test_the_index_lists_every_upstream_file_page():
    index = read(os.path.join(DOCS, "README.md"))
    pages = [p for p in markdown_files() if os.path.relpath(p, DOCS).startswith("srt" + os.sep)]
    assert len(pages) >= 16
    unlisted = [os.path.relpath(p, DOCS) for p in pages if f"]({os.path.relpath(p, DOCS)})" not in index]
    assert not unlisted, f"pages missing from docs/upstream/README.md: {unlisted}"
    hooked_files = {upstream_file_and_symbol(h.target)[0] for h in plugin_hooks()}
    for rel in hooked_files:
        assert f"`srt/{rel[len('srt/'):]}`" in index, f"{rel} missing from the index table"


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", sorted(os.path.relpath(p, DOCS) for p in markdown_files()))
def test_relative_links_resolve(page):
    path = os.path.join(DOCS, page)
    broken = [
        link
        for link in LINK.findall(read(path))
        if "://" not in link and not os.path.exists(os.path.join(os.path.dirname(path), link))
    ]
    assert not broken, f"{page}: broken links {broken}"


TEST_PATH = re.compile(r"\btest/[\w/]+\.py\b")
TEST_NAME = re.compile(r"(?<![\w/])(test_[a-z0-9_]+\.py)\b")


def test_named_test_files_exist():
    tests = {f for d in ("srt", "e2e") for f in os.listdir(os.path.join(REPO, "test", d))}
    missing = set()
    for path in markdown_files():
        text = read(path)
        missing |= {p for p in TEST_PATH.findall(text) if not os.path.isfile(os.path.join(REPO, p))}
        missing |= {n for n in TEST_NAME.findall(text) if n not in tests}
    assert not missing, f"docs/upstream names test files that do not exist: {sorted(missing)}"


def test_coverage_check_catches_a_hook_without_a_page():
    """The oracle of the first test can fail: an invented target has no page."""
    rel, symbol = upstream_file_and_symbol(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.send_kvcache"
    )
    assert (rel, symbol) == ("srt/disaggregation/mooncake/conn.py", "MooncakeKVManager.send_kvcache")
    rel, _ = upstream_file_and_symbol(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request"
    )
    assert not os.path.isfile(page_for(rel))


def test_every_upstream_file_the_series_changes_has_a_page_naming_its_commits():
    """Each upstream file a PR of the generated series edits has its page, and the page's
    "In the generated series" section is the one the registry and the stack document give now:
    the commits (by subject) that change the file, in the series' order, and what each does there
    (``python -m sglang_dflash_pp.tools.export_patches.pages --write`` rewrites it)."""
    from sglang_dflash_pp.tools.export_patches import pages, stack

    touched = pages.touched_files()
    edited = {e.file for pr in stack.FINISHED for e in pr.edits}
    created = {m.file for pr in stack.FINISHED for m in pr.new_modules}
    assert set(touched) == edited - created and len(touched) >= 20
    stale = []
    for file, prs in touched.items():
        path = page_for(file)
        assert os.path.isfile(path), f"no page for {file}: run pages --write"
        text = open(path).read()
        if pages.section(file) not in text:
            stale.append(os.path.relpath(path, DOCS))
        for n, _ in prs:  # the PR's commit, as the series names it
            assert f"**PR {n}: " in text, (file, n)
    assert not stale, f"stale series sections (run pages --write): {stale}"
    # the mooncake page names every Mooncake PR's commit, PR 16's included
    conn = open(page_for("srt/disaggregation/mooncake/conn.py")).read()
    assert all(f"**PR {n}: " in conn for n in ("4", "5", "7", "9", "6", "16"))
