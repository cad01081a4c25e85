"""The plugin manager: built-in plugins, third-party plugins from entry points (DESIGN.md, Hooks).

As pytest does it: :func:`plugin_manager` makes a :class:`pluggy.PluginManager` for project
``failslow`` with the specs of :mod:`failslow.hookspecs`, registers the built-ins
(:data:`DEFAULT_PLUGINS`, ordinary plugins like any other), then every plugin advertised in the
entry-point group ``failslow`` - unless ``FAILSLOW_DISABLE_PLUGIN_AUTOLOAD`` is set - then the
plugins named in ``FAILSLOW_PLUGINS`` (as ``PYTEST_PLUGINS``: every process of a job gets them,
the stop-time checks' too), and checks
that every registered implementation matches a spec (a typo in a hook name fails at start, not
silently). Adapters register themselves on the manager of their session.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterable
from typing import Any

import pluggy

from failslow import envvars, hookspecs
from failslow.errors import ConfigError

PROJECT = "failslow"
ENTRY_POINT_GROUP = "failslow"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "failslow.builtin.log_notifier",
    "failslow.builtin.tensorboard_notifier:NOTIFIER",
    "failslow.builtin.wandb_notifier:NOTIFIER",
)
"""Plugins registered in every plugin manager: a module (the module is the plugin) or
``module:attribute`` (that object is)."""

log = logging.getLogger(__name__)


def plugin_manager(
    plugins: Iterable[Any] = (), *, autoload: bool | None = None
) -> pluggy.PluginManager:
    """A manager with the built-ins, the entry-point plugins (unless disabled) and ``plugins``."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(_load(name), name=name)
    if autoload is None:
        autoload = not os.environ.get(envvars.DISABLE_PLUGIN_AUTOLOAD)
    if autoload:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:
            raise ConfigError(
                f"plugin from entry-point group {ENTRY_POINT_GROUP!r} failed to load: {exc} "
                f"(set {envvars.DISABLE_PLUGIN_AUTOLOAD}=1 to skip third-party plugins)"
            ) from exc
    for name in [n.strip() for n in os.environ.get(envvars.PLUGINS, "").split(",") if n.strip()]:
        try:
            plugin = _load(name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(
                f"${envvars.PLUGINS}: cannot load plugin {name!r} ({exc}); expected a module "
                f"or module:attribute"
            ) from None
        if not pm.is_registered(plugin):
            register(pm, plugin, name=name)
    for plugin in plugins:
        register(pm, plugin)
    check(pm)
    return pm


def _load(name: str) -> Any:
    """The plugin ``module`` or ``module:attribute`` names."""
    module, _, attribute = name.partition(":")
    plugin = importlib.import_module(module)
    return getattr(plugin, attribute) if attribute else plugin


def check(pm: pluggy.PluginManager) -> None:
    """Every registered ``failslow_*`` implementation must match a spec: one-line error if not."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise ConfigError(_one_line(exc)) from exc


def register(pm: pluggy.PluginManager, plugin: Any, name: str | None = None) -> None:
    """Register ``plugin`` and check it (an adapter's hook names are verified at once)."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise ConfigError(_one_line(exc)) from exc
    check(pm)


def _one_line(exc: pluggy.PluginValidationError) -> str:
    return "failslow plugin: " + "; ".join(p.strip() for p in str(exc).splitlines() if p.strip())
