"""``sglang-dflash-pp export-patches``: the change as an in-tree patch series on sglang 0.5.23.

Given an sglang tree (a copy of the installed wheel's ``sglang/`` package, or a checkout's
``python/sglang/``), the generator applies the PR stack of ``docs/upstream/README.md`` one PR at
a time and commits each with the PR's title and description; ``git format-patch`` of those
commits is the series. No upstream text is stored here: our pure modules move in-tree as new
files (``new_modules``), and every change to an upstream function is a ``libcst`` transformation
anchored on a symbol that inserts or replaces a few lines of our own code (``cst_edits``), listed
per PR in ``stack``. ``generator`` runs them; ``verify`` imports every prefix of the series and
runs the bug reproductions on the patched tree.
"""
