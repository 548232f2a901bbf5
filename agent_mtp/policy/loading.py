"""Load a policy from YAML (or a mapping, or a Policy) with errors that name the file, the line and the field.

pydantic reports where a value is wrong as a key path (``('steps', 'tool_call', 'threshold')``); the YAML node
tree (``yaml.compose``) keeps the line of every key and value, so the path is walked through the nodes to find
the line.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from agent_mtp.errors import PolicyError
from agent_mtp.policy.schema import Policy, semantic_problems

PRESETS_DIR = Path(__file__).resolve().parents[2] / "policies"
"""Where the shipped policies live (``policies/`` at the repository root)."""
PRESET_NAMES: tuple[str, ...] = ("default", "latency", "exact")

PolicySource = Policy | Mapping[str, Any] | str | os.PathLike[str]
Loc = tuple[str | int, ...]


def load_policy(source: PolicySource) -> Policy:
    """A validated :class:`Policy` from a Policy, a mapping, a YAML path, or a shipped name
    (default/latency/exact)."""
    if isinstance(source, Policy):
        _raise_if_problems(_semantic(source, None), "policy object")
        return source
    if isinstance(source, Mapping):
        return _validate(dict(source), root=None, where="policy mapping")
    path = resolve_policy_path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {path}: {exc.strerror}; check the path and permissions") from exc
    return parse_policy(text, source=str(path))


def resolve_policy_path(source: str | os.PathLike[str]) -> Path:
    """A shipped policy name (``default``, ``latency``, ``exact``) or a path to an existing YAML file."""
    text = os.fspath(source)
    if text in PRESET_NAMES:
        return PRESETS_DIR / f"{text}.yaml"
    path = Path(text).expanduser()
    if not path.is_file():
        names = ", ".join(PRESET_NAMES)
        msg = f"policy file {text!r} does not exist: pass a path to a YAML file or one of {names}"
        raise PolicyError(msg)
    return path


def parse_policy(text: str, *, source: str = "<string>") -> Policy:
    """Parse and validate policy YAML text; ``source`` names the file in error messages."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f", line {mark.line + 1}" if mark is not None else ""
        raise PolicyError(f"{source}{line}: not valid YAML: {exc.problem or exc}. Fix the syntax there.") from exc
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        msg = f"{source}, line 1: the policy is {kind}; write a mapping with keys like `version: 1`"
        raise PolicyError(msg)
    duplicates = _duplicate_keys(root)
    if duplicates:
        _raise_if_problems([(line, path, f"key {key!r} appears twice") for line, path, key in duplicates], source)
    return _validate(data, root=root, where=source)


def _validate(data: dict[str, Any], *, root: yaml.Node | None, where: str) -> Policy:
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        _raise_if_problems(_schema_problems(exc, root), where)
        raise  # unreachable: a ValidationError always has at least one error
    _raise_if_problems(_semantic(policy, root), where)
    return policy


def _raise_if_problems(problems: list[tuple[int | None, str, str]], where: str) -> None:
    if not problems:
        return
    lines = [f"  {where}{f', line {line}' if line else ''}, {path or '<top>'}: {msg}" for line, path, msg in problems]
    noun = "problem" if len(problems) == 1 else "problems"
    raise PolicyError(f"invalid policy {where} ({len(problems)} {noun}):\n" + "\n".join(lines))


# -------------------------------------------------------------------------------------------- error → message
def _schema_problems(exc: ValidationError, root: yaml.Node | None) -> list[tuple[int | None, str, str]]:
    grouped: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
    for err in exc.errors(include_url=False):
        loc, line = _locate(root, tuple(err["loc"]), key_line=err["type"] == "extra_forbidden")
        if err["type"] == "missing":
            loc = tuple(s for s in err["loc"] if not _is_tag(s))
        grouped.setdefault((_dotted(loc), line), []).append({**err, "loc": loc})
    problems = [(line, path, _describe(errs)) for (path, line), errs in grouped.items()]
    return sorted(problems, key=lambda p: p[0] or 0)


def _describe(errs: list[dict[str, Any]]) -> str:
    first = errs[0]
    loc: Loc = first["loc"]
    if first["type"] == "extra_forbidden":
        key = str(loc[-1]) if loc else "?"
        allowed = _allowed_keys(loc[:-1])
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown field {key!r}{hint}. Allowed fields here: {', '.join(allowed)}"
    if first["type"] == "missing":
        return f"required field {loc[-1]!r} is missing. Allowed: {_allowed_text(loc)}"
    reasons = "; ".join(dict.fromkeys(e["msg"] for e in errs))
    return f"{first['input']!r} is not allowed ({reasons}). Allowed: {_allowed_text(loc)}"


def _allowed_text(loc: Loc) -> str:
    _, info = _walk(loc)
    if info is not None and info.description:
        return info.description
    return "see docs/policies.md"


def _allowed_keys(loc: Loc) -> list[str]:
    model, _ = _walk(loc)
    return list(model.model_fields) if model is not None else []


def _dotted(loc: Loc) -> str:
    out = ""
    for seg in loc:
        out += f"[{seg}]" if isinstance(seg, int) else (f".{seg}" if out else str(seg))
    return out


# ------------------------------------------------------------------------------------------------- locations
def _locate(root: yaml.Node | None, loc: Loc, *, key_line: bool) -> tuple[Loc, int | None]:
    """Walk ``loc`` through the YAML nodes: the part of it that exists in the file, and the line it ends at."""
    if root is None:
        return tuple(s for s in loc if not _is_tag(s)), None
    node, line, used = root, root.start_mark.line + 1, 0
    for i, seg in enumerate(loc):
        nxt = _child(node, seg)
        if nxt is None:
            break
        key_node, node = nxt
        at_key = key_line or (i + 1 < len(loc) and loc[i + 1] == "[key]")
        line = (key_node if key_node is not None and at_key else node).start_mark.line + 1
        used += 1
    if key_line and used < len(loc):  # an unknown key that the walk could not enter
        key = _child(node, loc[used])
        used += 1
        if key is not None and key[0] is not None:
            line = key[0].start_mark.line + 1
    return loc[:used], line


def _child(node: yaml.Node, seg: str | int) -> tuple[yaml.Node | None, yaml.Node] | None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(seg):
                return key_node, value_node
    if isinstance(node, yaml.SequenceNode) and isinstance(seg, int) and 0 <= seg < len(node.value):
        return None, node.value[seg]
    return None


def _is_tag(seg: str | int) -> bool:
    """pydantic adds union member tags (``int``, ``literal['auto']``) and ``[key]`` to locations."""
    return isinstance(seg, str) and (seg in {"int", "float", "str", "bool", "[key]"} or seg.startswith("literal["))


def _duplicate_keys(root: yaml.Node | None, path: Loc = ()) -> list[tuple[int, str, str]]:
    found: list[tuple[int, str, str]] = []
    if isinstance(root, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in root.value:
            key = str(key_node.value)
            if key in seen:
                found.append((key_node.start_mark.line + 1, _dotted(path), key))
            seen.add(key)
            found.extend(_duplicate_keys(value_node, (*path, key)))
    elif isinstance(root, yaml.SequenceNode):
        for i, item in enumerate(root.value):
            found.extend(_duplicate_keys(item, (*path, i)))
    return found


# --------------------------------------------------------------------------------------------- schema walking
def _walk(loc: Loc) -> tuple[type[BaseModel] | None, FieldInfo | None]:
    """The model class reached by ``loc`` (None for a scalar) and the field that holds it."""
    tp: Any = Policy
    info: FieldInfo | None = None
    for seg in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel) and isinstance(seg, str) and seg in tp.model_fields:
            info = tp.model_fields[seg]
            tp = info.annotation
        elif typing.get_origin(tp) in (list, tuple) and isinstance(seg, int):
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict and isinstance(seg, str):
            tp = typing.get_args(tp)[1]
        else:
            return None, info
    tp = _unwrap(tp)
    model = tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None
    return model, info


def _unwrap(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        members = [_unwrap(a) for a in typing.get_args(tp) if a is not type(None)]
        for member in members:
            if (isinstance(member, type) and issubclass(member, BaseModel)) or typing.get_origin(member) in (
                list,
                dict,
            ):
                return member
        return members[0] if members else tp
    return tp


def _semantic(policy: Policy, root: yaml.Node | None) -> list[tuple[int | None, str, str]]:
    out: list[tuple[int | None, str, str]] = []
    for loc, msg in semantic_problems(policy):
        _, line = _locate(root, loc, key_line=False)
        out.append((line, _dotted(loc), msg))
    return sorted(out, key=lambda p: p[0] or 0)
