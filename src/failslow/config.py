"""failslow's settings: one dataclass tree, one loader (DESIGN.md; torchtitan's config habit).

Each component owns its section as a kw-only, slots dataclass - ``detection`` and ``validation``
(:mod:`failslow.core.localize.config`), ``planner`` (:mod:`failslow.core.planner.config`),
``checkpoint`` (:mod:`failslow.core.checkpoint.config`), ``checks``
(:mod:`failslow.core.diagnosis.metrics`) - and :class:`FailslowConfig` composes
them with the job-wide settings. Every source produces the same :class:`FailslowConfig`: the
``"failslow": {...}`` block of a DeepSpeed config (or any dict), environment variables and
command-line overrides. Precedence,
lowest first: defaults, the dict, the environment, explicit overrides. Unknown keys and values of
the wrong type are rejected with one line naming the key, where it came from and what is allowed.

Environment: ``FAILSLOW__SECTION__KEY=value`` (two underscores between levels, for example
``FAILSLOW__DETECTION__THRESHOLD=1.2``); ``FAILSLOW_STORE`` (set by ``failslow run
--controller``) is honoured as ``store``. Overrides: ``{"planner.min_gain": "0.1"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from failslow import envvars
from failslow.core.checkpoint.config import CheckpointConfig
from failslow.core.diagnosis.metrics import ChecksConfig
from failslow.core.localize.config import DetectionConfig, ValidationConfig
from failslow.core.planner.config import RULES, STRATEGIES, PlannerConfig
from failslow.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_ZERO_OK = (
    "min_gain",
    "cooldown_s",
    "microbatch_apply_s",
    "keep_steps",
    "every_steps",
    "metrics_port",
    "communication_mean_s",
    "jump",
)


@dataclass(kw_only=True, slots=True)
class ObserveConfig:
    """Where what failslow knows is published (:mod:`failslow.observe`); everything is off by
    default and turned on by one setting."""

    metrics_port: int | None = None
    """Prometheus metrics of the controller and the node publisher on this port (0: a free one,
    printed at start); None: no endpoint. ``failslow run --metrics-port`` sets it."""
    metrics_addr: str = "127.0.0.1"
    """The address the metrics endpoint binds to (``0.0.0.0`` to be scraped from elsewhere)."""
    tensorboard_dir: str | None = None
    """TensorBoard notifier: rank 0's step times and the controller's diagnoses and plans as
    scalars and text under this directory (needs the ``tensorboard`` package)."""
    wandb_project: str | None = None
    """W&B notifier: log into this project (rank 0 into the run it already has, if any; the
    controller into a run of its own). Needs ``wandb``."""
    wandb_mode: str = "online"
    """``online``, ``offline`` or ``disabled`` (``wandb.init(mode=...)``)."""


@dataclass(kw_only=True, slots=True)
class FailslowConfig:
    enabled: bool = True
    store: str | None = None
    """Control store URL (``tcp://HOST:PORT``, ``redis://HOST:PORT/DB``); None: no controller."""
    log_dir: str | None = None
    job_token: str | None = None
    """The job's shared secret (``failslow run`` generates one; every launcher of a job on
    several machines passes the same ``--job-token``): ranks act only on pause requests and
    plans that carry it. ``$FAILSLOW_JOB_TOKEN`` sets it."""
    capture: bool = True
    """Install the Python collective hook (``failslow run`` adds the NCCL shim)."""
    detection: DetectionConfig = field(default_factory=DetectionConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)


def _to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    return obj


# -------------------------------------------------------------------------------------------
# loading
# -------------------------------------------------------------------------------------------


def load_config(
    data: Mapping[str, Any] | None = None,
    *,
    source: str = "failslow config",
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> FailslowConfig:
    """Build the config from ``data`` (source named in errors), then the environment
    (``os.environ`` unless given; pass ``{}`` to ignore it), then ``overrides``."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    merged: dict[str, Any] = _nested_copy(data or {})
    origin = {"": source}
    env = os.environ if environ is None else environ
    for key, value in _from_env(env).items():
        _set_dotted(merged, key, value)
        name = envvars.CONFIG_PREFIX + key.replace(".", "__").upper()
        origin[key] = f"environment variable {name}"
    if envvars.STORE in env and "store" not in merged:
        merged["store"] = env[envvars.STORE]
    if envvars.JOB_TOKEN in env and "job_token" not in merged:
        merged["job_token"] = env[envvars.JOB_TOKEN]
    for key, value in (overrides or {}).items():
        _set_dotted(merged, key, value)
        origin[key] = f"override {key}"
    return _build(FailslowConfig, merged, "", origin)


BLOCK = "failslow"
"""The key of failslow's block in a framework's config (DeepSpeed ignores unknown keys)."""


def block_of(framework_config: Any, *, where: str) -> tuple[Any, str]:
    """failslow's block of a framework's config - a mapping, or the path of a JSON file - and
    the name of its source for error messages; ``(None, ...)`` when there is none. A file that
    is not JSON, or a config that is not a mapping, is a one-line ConfigError naming it."""
    if isinstance(framework_config, str | os.PathLike):
        where = f"{where} {os.fspath(framework_config)}"
        try:
            with open(framework_config) as fh:
                framework_config = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{where}: cannot read it as JSON: {exc}") from exc
    if framework_config is None:
        return None, where
    if not isinstance(framework_config, Mapping):
        raise ConfigError(f"{where}: expected a dict or a JSON file path")
    return framework_config.get(BLOCK), f"the {BLOCK!r} block of {where}"


def load_settings_file(path: str | os.PathLike[str]) -> tuple[Any, str]:
    """A JSON settings file: a framework config with a ``"failslow"`` block (that block), or
    failslow's own settings (the whole file); with the source name for error messages."""
    block, source = block_of(path, where="--config")
    if isinstance(block, Mapping):
        return block, source
    with open(path) as fh:  # readable: block_of read it
        return json.load(fh), f"--config {os.fspath(path)}"


def as_config(settings: FailslowConfig | Mapping[str, Any] | None, source: str) -> FailslowConfig:
    """``settings`` as a :class:`FailslowConfig` (a mapping is loaded, with the environment)."""
    if isinstance(settings, FailslowConfig):
        return settings
    return load_config(settings, source=source)


def _nested_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _nested_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _from_env(env: Mapping[str, str]) -> dict[str, str]:
    found = {}
    for name, value in env.items():
        if name.startswith(envvars.CONFIG_PREFIX):
            found[name[len(envvars.CONFIG_PREFIX) :].lower().replace("__", ".")] = value
    return found


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"failslow config: {part!r} is a value, not a section")
        target = child
    target[last] = value


def _where(origin: Mapping[str, str], path: str) -> str:
    return origin.get(path, origin[""])


def _build(cls: type, data: Mapping[str, Any], path: str, origin: Mapping[str, str]) -> Any:
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}{key}"
        if key not in allowed:
            section = f" in section {path[:-1]!r}" if path else ""
            raise ConfigError(
                f"{_where(origin, dotted)}: unknown key {key!r}{section}; "
                f"allowed: {', '.join(allowed)}"
            )
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{_where(origin, dotted)}: {dotted!r} is a section: expected a mapping, "
                    f"got {value!r}"
                )
            kwargs[key] = _build(hint, value, dotted + ".", origin)
        else:
            kwargs[key] = _coerce(value, hint, dotted, _where(origin, dotted))
    config = cls(**kwargs)
    _check_values(config, path, origin)
    return config


def _coerce(value: Any, hint: Any, dotted: str, where: str) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}: {dotted!r} must be {expected}, got {value!r}")

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None or (isinstance(value, str) and value.lower() in ("", "none", "null")):
            return None
        (hint,) = [a for a in args if a is not type(None)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise bad("true or false")
    if hint in (int, float):
        if isinstance(value, bool):
            raise bad(f"a number ({hint.__name__})")
        try:
            number = hint(value) if isinstance(value, str) else value
        except ValueError:
            raise bad(f"a number ({hint.__name__})") from None
        if hint is int and not isinstance(number, int):
            raise bad("an integer")
        if not isinstance(number, int | float):
            raise bad(f"a number ({hint.__name__})")
        return hint(number)
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            value = json.loads(value) if value.startswith("[") else value.split(",")
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return tuple(v.strip() for v in value)
    raise bad(str(hint))  # pragma: no cover - every field type is handled above


def _check_values(config: Any, path: str, origin: Mapping[str, str]) -> None:
    """Ranges: durations and sizes positive, strategies known."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        dotted = f"{path}{f.name}"
        if isinstance(value, float | int) and not isinstance(value, bool):
            ok = value >= 0 if f.name in _ZERO_OK else value > 0
            if not ok:
                low = ">= 0" if f.name in _ZERO_OK else "> 0"
                raise ConfigError(
                    f"{_where(origin, dotted)}: {dotted!r} must be {low}, got {value!r}"
                )
    if isinstance(config, ObserveConfig):
        if config.metrics_port is not None and config.metrics_port > 65535:
            raise ConfigError(
                f"{_where(origin, path + 'metrics_port')}: 'observe.metrics_port' must be a "
                f"port (0-65535), got {config.metrics_port}"
            )
        if config.wandb_mode not in ("online", "offline", "disabled"):
            raise ConfigError(
                f"{_where(origin, path + 'wandb_mode')}: 'observe.wandb_mode' must be online, "
                f"offline or disabled, got {config.wandb_mode!r}"
            )
    if isinstance(config, ChecksConfig):
        if 0 < config.jump <= 1 or config.warmup > config.window:
            raise ConfigError(
                f"{_where(origin, path + 'jump')}: the 'checks' section needs jump 0 (off) or "
                f"> 1 and warmup <= window, got jump {config.jump}, warmup {config.warmup}, "
                f"window {config.window}"
            )
    if isinstance(config, PlannerConfig):
        if config.rule not in RULES:
            raise ConfigError(
                f"{_where(origin, path + 'rule')}: 'planner.rule' must be one of "
                f"{', '.join(RULES)}, got {config.rule!r}"
            )
        if config.earliest > 1.0:
            raise ConfigError(
                f"{_where(origin, path + 'earliest')}: 'planner.earliest' must be in (0, 1], "
                f"got {config.earliest!r}"
            )
        for name in config.strategies:
            if name not in STRATEGIES:
                raise ConfigError(
                    f"{_where(origin, path + 'strategies')}: unknown strategy {name!r}; "
                    f"allowed: {', '.join(STRATEGIES)}"
                )
