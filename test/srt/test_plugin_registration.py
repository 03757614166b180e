"""Discovery through the entry point, SGLang's own loader, the version gate, the applied-check."""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

import pytest

import sglang_dflash_pp
from sglang_dflash_pp import hooks, plugin


def test_entry_point_is_discoverable():
    found = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dflash_pp"]
    assert len(found) == 1
    assert found[0].value == "sglang_dflash_pp.plugin:register"
    assert found[0].dist.name == "sglang-dflash-pp"
    assert found[0].load() is plugin.register


def test_load_plugins_registers_and_applies_every_hook(sglang_with_plugin):
    from sglang.srt.plugins.hook_registry import HookRegistry

    registered = hooks.registered_hooks()
    assert {h.target for h in registered} >= {
        "sglang.srt.arg_groups.speculative_hook._handle_dflash",
        "sglang.srt.arg_groups.validation_hook.check_pipeline_parallel_compat",
    }
    for h in registered:
        assert h.target in HookRegistry._patched, h.target
        assert hooks.is_applied(h), h.name
    assert hooks.unapplied_hooks() == []


def test_is_applied_sees_a_reverted_target(sglang_with_plugin, monkeypatch):
    import sglang.srt.arg_groups.speculative_hook as speculative_hook

    (gate,) = [h for h in hooks.registered_hooks() if h.target.endswith("._handle_dflash")]
    monkeypatch.setattr(speculative_hook, "_handle_dflash", speculative_hook._handle_dflash.__wrapped__)
    assert not hooks.is_applied(gate)
    with pytest.raises(RuntimeError) as info:
        hooks.require_hooks_applied("DFLASH with --pp-size > 1")
    assert "AROUND sglang.srt.arg_groups.speculative_hook._handle_dflash" in str(info.value)


def test_version_gate_refuses_other_sglang(monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(plugin, "_installed_sglang_version", lambda: "0.5.22")
    before = {t: len(v) for t, v in HookRegistry._hooks.items()}
    with caplog.at_level(logging.ERROR, logger=plugin.__name__):
        assert plugin.register() is False
    after = {t: len(v) for t, v in HookRegistry._hooks.items()}
    assert before == after, "an inactive plugin must register nothing"
    messages = [r.getMessage() for r in caplog.records if r.name == plugin.__name__]
    assert len(messages) == 1
    assert f"requires sglang=={sglang_dflash_pp.REQUIRED_SGLANG_VERSION}, found 0.5.22" in messages[0]


def test_version_gate_accepts_the_pinned_release():
    assert plugin._installed_sglang_version() == sglang_dflash_pp.REQUIRED_SGLANG_VERSION
