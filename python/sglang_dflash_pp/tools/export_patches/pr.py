"""One PR of the stack as the generator has it: its in-tree edits, new modules and the tests
that move with them, or why it has none yet. The registry (:mod:`.stack`) lists them; the
groups' own modules define them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from sglang_dflash_pp.tools.export_patches.cst_edits import Edit
from sglang_dflash_pp.tools.export_patches.new_modules import NewModule
from sglang_dflash_pp.tools.export_patches.new_tests import NewTest


@dataclass(frozen=True)
class PR:
    number: str
    edits: Tuple[Edit, ...] = ()
    new_modules: Tuple[NewModule, ...] = ()
    # our unit tests of this PR's code, moved in-tree (test/registered/...) with it
    tests: Tuple[NewTest, ...] = ()
    note: str = ""  # our paragraph for the commit message: the choice taken, how it is tested
    bug: Optional[str] = None  # docs/upstream/bugs/<bug>/repro.py prints the right answer after it
    # keys of that repro's ``observed`` it cannot show fixed on a patched tree (it exercises them
    # without the code this PR changes); checked another way in test_export_patches
    bug_unshown: Tuple[str, ...] = ()
    unfinished: Optional[str] = None  # why the generator has no complete in-tree form of it yet

    @property
    def finished(self) -> bool:
        return self.unfinished is None

    def touched_modules(self) -> Tuple[str, ...]:
        """The in-tree modules this PR edits or adds, as importable names."""
        files = [e.file for e in self.edits] + [m.file for m in self.new_modules]
        names = []
        for f in files:
            name = "sglang." + f[: -len(".py")].replace("/", ".")
            if name not in names:
                names.append(name)
        return tuple(names)
