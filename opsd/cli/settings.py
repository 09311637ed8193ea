"""One settings object for ``opsd serve``, ``opsd run`` and ``opsd agent``: every key of the controller's and the
agent's configuration, read from a TOML or YAML file (``--config``), overridden by ``OPSD_*`` environment
variables, overridden by command-line flags (docs/configuration.md lists every key).

The file has two sections, each a frozen configuration dataclass of the code, nested tables for nested ones:

    [controller]                # ControllerSettings: ServeConfig and ControllerConfig inline, the backend
    port = 8470
    hang_floor_s = 60           # no: it is controller.detection.hang_floor_s
    [controller.detection]
    hang_floor_s = 60
    [agent]                     # opsd_agent.daemon.AgentConfig
    socket = "/run/opsd/agent.sock"

Each key has an environment variable: ``OPSD_`` and its path in capitals, joined by ``_``
(``OPSD_CONTROLLER_DETECTION_HANG_FLOOR_S``); a few keep the names they had before this file existed
(``OPSD_STATE_DIR``, ``OPSD_TOKEN``, ``OPSD_POLICY_FILE``: ``ENV_ALIASES``). A key the code does not have, a value
of the wrong type, or one its dataclass refuses, is a ``ConfigError`` that names the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import yaml

from opsd.errors import ConfigError
from opsd.protocol.env import (
    AGENT_SOCKET_ENV,
    CONTROLLER_TOKEN_ENV,
    FLIGHT_DIR_ENV,
    POLICY_FILE_ENV,
    STATE_DIR_ENV,
    STATE_URL_ENV,
    TOKEN_ENV,
)
from opsd.runtime.config import ServeConfig
from opsd.runtime.registry import BUILT_IN, backends
from opsd_agent.daemon import AgentConfig


@dataclass(frozen=True)
class ControllerSettings:
    """``opsd serve``'s settings: the server's and the controller's (inline: ``controller.port``,
    ``controller.detection.hang_floor_s``), the backend, and each backend's own section (``controller.<name>``, the
    registry's ``config``: ``controller.kubernetes``)."""

    serve: ServeConfig = field(default_factory=ServeConfig, metadata={"inline": True})
    backend: str = "none"  # a name of the registry (opsd.runtime.registry): what recovers runs
    sections: dict[str, object] = field(default_factory=dict, metadata={"backends": True})  # name -> its section

    def __post_init__(self) -> None:
        known = backends()
        if self.backend not in known:
            raise ValueError(f"controller.backend must be one of {', '.join(known)}, not {self.backend!r}")

    def section(self, name: str) -> object:
        """A backend's section of the settings (its defaults when none was given); None for one without."""
        entry = backends()[name]
        return self.sections.get(name) or (entry.config() if entry.config is not None else None)


#: ``--backend``'s choices: "none (incidents recorded, ...), kubernetes (...)", and the plug-ins installed
BACKEND_CHOICES = ", ".join(f"{entry.name} ({entry.description})" for entry in BUILT_IN) + ", or a plug-in's name"
#: the file's sections and the dataclass each one is
SECTIONS: dict[str, type[Any]] = {"controller": ControllerSettings, "agent": AgentConfig}
#: keys whose environment variable is not the generated one
ENV_ALIASES = {
    "controller.state_dir": STATE_DIR_ENV,
    "controller.state_url": STATE_URL_ENV,
    "controller.token": TOKEN_ENV,
    "agent.socket": AGENT_SOCKET_ENV,
    "agent.controller_token": CONTROLLER_TOKEN_ENV,
    "agent.policy_file": POLICY_FILE_ENV,
    "agent.flight_dir": FLIGHT_DIR_ENV,
}
T = TypeVar("T")


@dataclass(frozen=True)
class Key:
    """One setting: its dotted path (``controller.detection.hang_floor_s``), its type and its default."""

    path: str
    type: Any  # a type annotation: int, float | None, an Enum, ...
    default: Any  # a value of that type

    @property
    def env(self) -> str:
        return ENV_ALIASES.get(self.path, "OPSD_" + self.path.replace(".", "_").upper())


def keys(section: str) -> list[Key]:
    """Every key of a section, in the order of its dataclass's fields (nested ones where they are declared)."""
    return list(_keys(SECTIONS[section], section))


def _keys(cls: type[Any], prefix: str) -> list[Key]:
    hints = get_type_hints(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if f.metadata.get("backends"):  # each backend's section, named after it
            for entry in backends().values():
                out += _keys(entry.config, f"{prefix}.{entry.name}") if entry.config is not None else []
        elif dataclasses.is_dataclass(kind):
            out += _keys(kind, prefix if f.metadata.get("inline") else f"{prefix}.{f.name}")  # type: ignore[arg-type]
        elif f.default is not dataclasses.MISSING:
            out.append(Key(f"{prefix}.{f.name}", kind, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append(Key(f"{prefix}.{f.name}", kind, f.default_factory()))
        else:
            out.append(Key(f"{prefix}.{f.name}", kind, None))  # required: no default
    return out


def load(
    section: str,
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> Any:
    """The section's configuration: its defaults (``defaults`` in place of the code's, for a command whose own
    differ), then the file's values, then the environment's, then the flags' (``flags`` and ``defaults``: key path
    below the section -> value; a flag's None means "not given")."""
    cls = SECTIONS[section]
    known = {k.path: k for k in keys(section)}
    values: dict[str, tuple[object, str]] = {}
    for name, value in (defaults or {}).items():
        values[f"{section}.{name}"] = (value, "the command's defaults")
    if path:
        for name, value in flatten(read_file(path).get(section) or {}, section, path).items():
            if name not in known:
                raise ConfigError(f"{path}: unknown key {name} (the keys are in docs/configuration.md)")
            values[name] = (convert(value, known[name], path), path)
    for key in known.values():
        text = (env if env is not None else os.environ).get(key.env)
        if text is not None:
            values[key.path] = (parse(text, key, f"${key.env}"), f"${key.env}")
    for name, value in (flags or {}).items():
        if value is not None:
            values[f"{section}.{name}"] = (convert(value, known[f"{section}.{name}"], "the command line"), "flag")
    try:
        return build(cls, section, {k: v for k, (v, _) in values.items()})
    except ValueError as exc:
        sources = ", ".join(sorted({source for _, source in values.values()})) or "the defaults"
        raise ConfigError(f"{exc} (settings from {sources})") from None


def read_file(path: str) -> dict[str, object]:
    """A settings file: TOML (``.toml``) or YAML (anything else, JSON included)."""
    try:
        text = Path(path).read_text()
        doc = tomllib.loads(text) if path.endswith(".toml") else yaml.safe_load(text)
    except FileNotFoundError:
        raise ConfigError(f"settings file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"settings file {path}: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"settings file {path}: expected a table of sections ({', '.join(SECTIONS)})")
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"settings file {path}: unknown sections {unknown} (the sections: {', '.join(SECTIONS)})")
    return doc


def flatten(table: object, prefix: str, where: str) -> dict[str, object]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: {prefix} must be a table")
    out: dict[str, object] = {}
    for name, value in table.items():
        key = f"{prefix}.{name}"
        if isinstance(value, dict):
            out.update(flatten(value, key, where))
        else:
            out[key] = value
    return out


def convert(value: object, key: Key, where: str) -> object:
    """``value`` as the key's type; ``ConfigError`` naming the key when it is not one."""
    kind = key.type
    options = [a for a in get_args(kind) if a is not type(None)] if _optional(kind) else [kind]
    if value is None and _optional(kind):
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if isinstance(option, type) and issubclass(option, enum.Enum) and isinstance(value, str):
            try:
                return option(value)
            except ValueError:
                choices = ", ".join(str(m.value) for m in option)
                raise ConfigError(f"{where}: {key.path} must be one of {choices}, not {value!r}") from None
    raise ConfigError(f"{where}: {key.path} must be {_describe(kind)}, not {value!r}")


def parse(text: str, key: Key, where: str) -> object:
    """An environment variable's text as the key's type."""
    kind = key.type
    options = [a for a in get_args(kind) if a is not type(None)] if _optional(kind) else [kind]
    if text == "" and _optional(kind):
        return None
    for option in options:
        try:
            if option is bool:
                lowered = text.strip().lower()
                if lowered in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    return lowered in ("1", "true", "yes", "on")
            elif option is int:
                return int(text)
            elif option is float:
                return float(text)
            elif option is str:
                return text
            elif isinstance(option, type) and issubclass(option, enum.Enum):
                return convert(text, key, where)
        except ValueError:
            continue
    raise ConfigError(f"{where}: {key.path} must be {_describe(kind)}, not {text!r}")


def build(cls: type[T], prefix: str, values: Mapping[str, object]) -> T:
    """An instance of ``cls`` from the values given (dotted paths), its defaults for the others."""
    hints = get_type_hints(cls)
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[f.name]
        if f.metadata.get("backends"):
            configs = {e.name: e.config for e in backends().values() if e.config is not None}
            kwargs[f.name] = {name: build(config, f"{prefix}.{name}", values) for name, config in configs.items()}
        elif dataclasses.is_dataclass(kind):
            inner = prefix if f.metadata.get("inline") else f"{prefix}.{f.name}"
            if any(k.startswith(inner + ".") for k in values):
                kwargs[f.name] = build(kind, inner, values)  # type: ignore[arg-type]
        elif f"{prefix}.{f.name}" in values:
            kwargs[f.name] = values[f"{prefix}.{f.name}"]
    return cls(**kwargs)


def _optional(kind: object) -> bool:
    return get_origin(kind) in (typing.Union, types.UnionType) and type(None) in get_args(kind)


def _describe(kind: object) -> str:
    if _optional(kind):
        return " or ".join(_describe(a) for a in get_args(kind) if a is not type(None)) + " (or empty)"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in kind)
    names: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(kind, str(kind))
