"""The plugin manager: specs, built-ins, entry points, validation of implementations."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from typing import ClassVar

import pluggy
import pytest

import failslow
from failslow import envvars, plugins
from failslow.capabilities import Capabilities, Unsupported
from failslow.errors import ConfigError


class Recorder:
    def __init__(self) -> None:
        self.seen: list[str] = []

    @failslow.hookimpl
    def failslow_on_step(self, step: int, step_time_s: float) -> None:
        self.seen.append(f"step {step}")

    @failslow.hookimpl
    def failslow_report_topology(self) -> None:
        return None


def test_specs_are_registered_and_builtins_loaded() -> None:
    pm = plugins.plugin_manager(autoload=False)
    names = {name for name in dir(pm.hook) if name.startswith("failslow_")}
    for required in (
        "failslow_report_topology",
        "failslow_apply_microbatch_plan",
        "failslow_apply_topology_plan",
        "failslow_snapshot_state",
        "failslow_restore_state",
        "failslow_hot_update",
        "failslow_on_diagnosis",
        "failslow_on_plan",
    ):
        assert required in names
    assert pm.has_plugin(plugins.DEFAULT_PLUGINS[0])


def test_decision_hooks_take_the_first_answer_and_observers_all_run() -> None:
    class Answer:
        @failslow.hookimpl
        def failslow_report_topology(self) -> str:
            return "the topology"

    first, second = Recorder(), Recorder()
    pm = plugins.plugin_manager([Answer(), first, second], autoload=False)
    assert pm.hook.failslow_report_topology() == "the topology"  # Recorder's None is skipped
    pm.hook.failslow_on_step(step=3, step_time_s=0.1)
    assert first.seen == second.seen == ["step 3"]


def test_a_misspelt_hook_is_a_one_line_error() -> None:
    class Typo:
        @failslow.hookimpl
        def failslow_on_diagnosys(self, diagnosis: object) -> None: ...

    with pytest.raises(ConfigError, match="unknown hook 'failslow_on_diagnosys'"):
        plugins.plugin_manager([Typo()], autoload=False)
    pm = plugins.plugin_manager(autoload=False)
    with pytest.raises(ConfigError, match="failslow_on_diagnosys"):
        plugins.register(pm, Typo())


def test_a_wrong_argument_name_is_rejected() -> None:
    class Wrong:
        @failslow.hookimpl
        def failslow_on_step(self, stepp: int) -> None: ...

    with pytest.raises(ConfigError, match="stepp"):
        plugins.plugin_manager([Wrong()], autoload=False)


def _fake_entry_point(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> None:
    """An installed distribution advertising ``module`` in the ``failslow`` group."""

    class EntryPoint:
        name, group, value = "third-party", plugins.ENTRY_POINT_GROUP, "x:y"

        def load(self) -> types.ModuleType:
            return module

    class Dist:
        metadata: ClassVar = {"name": "third-party-plugin"}
        entry_points = (EntryPoint(),)

    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [Dist()])


def test_entry_point_plugins_load_unless_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("third_party")
    calls: list[int] = []
    module.failslow_on_step = failslow.hookimpl(  # type: ignore[attr-defined]
        lambda step, step_time_s: calls.append(step)
    )
    _fake_entry_point(monkeypatch, module)
    monkeypatch.delenv(envvars.DISABLE_PLUGIN_AUTOLOAD, raising=False)
    pm = plugins.plugin_manager()
    pm.hook.failslow_on_step(step=1, step_time_s=0.0)
    assert calls == [1]
    monkeypatch.setenv(envvars.DISABLE_PLUGIN_AUTOLOAD, "1")
    plugins.plugin_manager().hook.failslow_on_step(step=2, step_time_s=0.0)
    assert calls == [1]


def test_a_broken_entry_point_names_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        name, group, value = "broken", plugins.ENTRY_POINT_GROUP, "x:y"

        def load(self) -> None:
            raise ImportError("no module named x")

    class Dist:
        metadata: ClassVar = {"name": "broken"}
        entry_points = (Broken(),)

    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [Dist()])
    with pytest.raises(ConfigError, match=envvars.DISABLE_PLUGIN_AUTOLOAD):
        plugins.plugin_manager(autoload=True)


def test_plugins_named_in_the_environment_are_registered_in_every_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``$FAILSLOW_PLUGINS`` (as ``PYTEST_PLUGINS``): modules or ``module:attribute``, for every
    process of a job; a name that does not load is a one-line error naming it."""
    calls: list[tuple[str, int]] = []
    module = types.ModuleType("job_plugin")
    module.failslow_on_step = failslow.hookimpl(  # type: ignore[attr-defined]
        lambda step, step_time_s: calls.append(("module", step))
    )

    class Plugin:
        @failslow.hookimpl
        def failslow_on_step(self, step: int, step_time_s: float) -> None:
            calls.append(("object", step))

    module.PLUGIN = Plugin()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "job_plugin", module)
    monkeypatch.setenv(envvars.PLUGINS, "job_plugin, job_plugin:PLUGIN,job_plugin")
    plugins.plugin_manager().hook.failslow_on_step(step=3, step_time_s=0.0)
    assert sorted(calls) == [("module", 3), ("object", 3)]  # a repeated name: once
    monkeypatch.setenv(envvars.PLUGINS, "job_plugin:MISSING")
    with pytest.raises(ConfigError, match=r"FAILSLOW_PLUGINS: cannot load plugin 'job_plugin:MIS"):
        plugins.plugin_manager()
    monkeypatch.setenv(envvars.PLUGINS, "no_such_module_here")
    with pytest.raises(ConfigError, match="no_such_module_here"):
        plugins.plugin_manager()


def test_capabilities_fail_loudly() -> None:
    caps = Capabilities(
        microbatch_plans="", topology_plans="no regrouping", snapshots="later", hot_update="later"
    )
    caps.require("microbatch_plans")
    with pytest.raises(Unsupported, match="topology_plans is not supported here: no regrouping"):
        caps.require("topology_plans")
    with pytest.raises(ValueError, match="unknown capability"):
        caps.require("teleport")
    assert Capabilities.from_dict(caps.to_dict()) == caps
    assert isinstance(pluggy.HookimplMarker("failslow"), type(failslow.hookimpl))
