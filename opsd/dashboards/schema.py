"""A dashboard's JSON checked against Grafana's own dashboard model: the typed models of Grafana's foundation SDK
(``grafana-foundation-sdk``, generated from Grafana's schemas), with each panel's ``options`` and
``fieldConfig.defaults.custom`` read by its panel kind's model and each query by its data source's.

The SDK's ``from_json`` reads what it knows and drops the rest, and checks no types; ``schema_problems`` reads the
dashboard into the models, then reports every field the round trip dropped (a field Grafana's model does not
have, at any depth) and every value whose type is not the one the model declares (a string ``gridPos.w``, a colour
mode that is not one of the enum's values), each with its path: ``panels[3].options.color.mode``.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import types
import typing
from collections.abc import Mapping
from typing import Any

from grafana_foundation_sdk.cog import plugins, runtime, variants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

log = logging.getLogger(__name__)

MODELS_PACKAGE = "grafana_foundation_sdk.models."


@functools.cache
def _register_plugins() -> None:
    """The panel kinds' and data sources' models, once (the SDK keeps them in a process-wide registry)."""
    plugins.register_default_plugins()


def schema_problems(board: Mapping[str, Any]) -> list[str]:
    """What in ``board`` Grafana's dashboard model does not have or types otherwise; an empty list: none."""
    _register_plugins()
    name = str(board.get("title") or board.get("uid") or "dashboard")
    try:
        model = Dashboard.from_json(dict(board))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a field of the wrong shape: from_json stops
        return [f"{name}: not readable as Grafana's dashboard model ({type(exc).__name__}: {exc})"]
    problems: list[str] = []
    for i, panel in enumerate(board.get("panels") or []):
        kind = panel.get("type") if isinstance(panel, Mapping) else None
        if kind != "row" and runtime.panelcfg_config(str(kind)) is None:
            problems.append(f"panels[{i}]: the panel type {kind!r} is not one Grafana's model knows")
    _check_type(model, Dashboard, "", problems)
    again = json.loads(json.dumps(model, cls=JSONEncoder))
    _dropped(board, again, "", problems)
    return [f"{name}: {p}" for p in problems] if problems else []


# -- fields the model does not have -----------------------------------------------------------------------------------
def _dropped(original: Any, again: Any, path: str, problems: list[str]) -> None:
    if isinstance(original, Mapping) and isinstance(again, Mapping):
        for key, value in original.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in again:
                problems.append(f"{where}: a field Grafana's model does not have")
            else:
                _dropped(value, again[key], where, problems)
    elif isinstance(original, list) and isinstance(again, list):
        for i, (value, other) in enumerate(zip(original, again, strict=False)):
            _dropped(value, other, f"{path}[{i}]", problems)


# -- types ------------------------------------------------------------------------------------------------------------
_FIELDS: dict[type, dict[str, Any]] = {}
_JSON_NAMES: dict[type, dict[str, str]] = {}


def _fields(cls: type) -> dict[str, Any]:
    """The declared types of a model class's attributes (its annotations, forward references resolved)."""
    if cls not in _FIELDS:
        _FIELDS[cls] = typing.get_type_hints(cls)
    return _FIELDS[cls]


def _is_model(cls: Any) -> bool:
    return isinstance(cls, type) and cls.__module__.startswith(MODELS_PACKAGE) and not issubclass(cls, enum.Enum)


def _check_type(value: Any, hint: Any, path: str, problems: list[str]) -> None:
    """Append to ``problems`` where ``value`` (read by ``from_json``, which checks nothing) is not of type ``hint``."""
    wrong = _mismatch(value, hint, path)
    if wrong is not None:
        problems.append(wrong)
        return
    model = _strip_optional(hint)
    if _is_model(model) and isinstance(value, dict):
        # a few fields (a panel's transformations) stay plain JSON after from_json: read them here
        try:
            read = model.from_json(value)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            problems.append(f"{path}: not readable as a {model.__name__} ({type(exc).__name__}: {exc})")
            return
        _dropped(value, json.loads(json.dumps(read, cls=JSONEncoder)), path, problems)
        value = read
    if isinstance(value, runtime.UnknownDataquery):
        problems.append(f"{path}: a query of a data source type Grafana's model does not know")
    elif _is_model(type(value)):
        for attribute, declared in _fields(type(value)).items():
            found = getattr(value, attribute, None)
            if found is not None:
                _check_type(found, declared, f"{path}.{_json_name(value, attribute)}".lstrip("."), problems)
    elif isinstance(value, list):
        (item,) = typing.get_args(_strip_optional(hint)) or (Any,)
        for i, element in enumerate(value):
            _check_type(element, _arm(element, item), f"{path}[{i}]", problems)
    elif isinstance(value, dict):
        args = typing.get_args(_strip_optional(hint))
        for key, element in value.items():
            _check_type(element, args[1] if len(args) == 2 else Any, f"{path}.{key}", problems)


def _mismatch(value: Any, hint: Any, path: str) -> str | None:
    """Why ``value`` is not a ``hint``, or None when it is (containers: only the container's own type)."""
    if hint is Any or hint is object:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        if value is None and type(None) in arms:
            return None
        arms = tuple(a for a in arms if a is not type(None))
        if len(arms) == 1:
            return _mismatch(value, arms[0], path)
        if any(_mismatch(value, arm, path) is None for arm in arms):
            return None
        return f"{path}: {_show(value)} is none of {', '.join(_name(a) for a in arms)}"
    if origin is typing.Literal:
        literals = typing.get_args(hint)
        return None if value in literals else f"{path}: {_show(value)} is none of {', '.join(map(repr, literals))}"
    if origin in (list, dict):
        return None if isinstance(value, origin) else f"{path}: {_show(value)} is not a {_name(hint)}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [m.value for m in hint]
        ok = isinstance(value, hint) or (value in allowed and not isinstance(value, bool))
        return None if ok else f"{path}: {_show(value)} is none of {', '.join(map(repr, allowed))}"
    if hint is type(None):
        return None if value is None else f"{path}: {_show(value)} is not null"
    if hint is bool:
        return None if isinstance(value, bool) else f"{path}: {_show(value)} is not a boolean"
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"{path}: {_show(value)} is not an integer"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return None if ok else f"{path}: {_show(value)} is not a number"
    if hint is str:
        return None if isinstance(value, str) else f"{path}: {_show(value)} is not a string"
    if isinstance(hint, type):
        ok = isinstance(value, hint) or (_is_model(hint) and isinstance(value, dict))  # a dict: read by _check_type
        return None if ok else f"{path}: {_show(value)} is not a {_name(hint)}"
    return None  # a hint this check does not understand: not reported


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(hint) if a is not type(None)]
        return arms[0] if len(arms) == 1 else hint
    return hint


def _arm(value: Any, hint: Any) -> Any:
    """The arm of a union ``value`` is (the one to check its fields by), or ``hint`` itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(hint) if _mismatch(value, a, "") is None), hint)
    return hint


def _json_name(model: Any, attribute: str) -> str:
    """The JSON name of a model's attribute (``grid_pos`` -> ``gridPos``), from the model's own ``to_json``."""
    names = _json_names(type(model))
    return names.get(attribute, attribute)


def _json_names(cls: type) -> dict[str, str]:
    """Attribute -> JSON name, found by setting each attribute of a fresh model to a marker and encoding it."""
    if cls in _JSON_NAMES:
        return _JSON_NAMES[cls]
    found: dict[str, str] = _JSON_NAMES.setdefault(cls, {})
    try:
        blank = cls()
    except TypeError:
        return found
    for attribute in _fields(cls):
        marker, before = f"\0{attribute}", getattr(blank, attribute, None)
        setattr(blank, attribute, marker)
        try:
            encoded = blank.to_json()
        except (AttributeError, TypeError, ValueError):
            encoded = {}
        setattr(blank, attribute, before)
        key = next((k for k, v in encoded.items() if v == marker), None)
        if key is not None:
            found[attribute] = key
    return found


def _name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _show(value: Any) -> str:
    text = json.dumps(value, cls=JSONEncoder) if not isinstance(value, variants.Dataquery) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."
