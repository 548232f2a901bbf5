"""Tools for a local model: schemas -> prompt block and grammar, model text -> LangChain tool calls.

The tool-call syntax (used in the prompt, in the grammar, and when earlier calls are rendered into the
history)::

    <tool_call>
    {"name": "get_weather", "arguments": {"location": "Paris"}}
    </tool_call>

JSON inside is on one line with ``json.dumps``' default separators and keys come in a fixed order (``name``, then
``arguments`` in the schema's property order), so most of a call is forced by the grammar and appended by
jump-forward.

Which grammar a ``tool_choice`` gets (:func:`tool_call_grammar`):

* ``"any"`` / a tool name: one call (or several with ``parallel_tool_calls=True``) from the first token;
* ``"auto"`` (or unset): free text, and once the text reaches ``<tool_call>`` a constrained call;
  with a ``response_format`` schema the free text is replaced by a JSON answer matching it;
* ``"none"``: free text in which ``<tool_call>`` cannot appear (the tools are not in the prompt, but a history of
  calls would otherwise invite the model to imitate one).

Parsing (:func:`parse_tool_calls`) turns every complete block into a ``tool_call`` with a unique string id and
arguments coerced to the schema's types (``"3"`` -> 3 for an integer); blocks that are not valid JSON, name an
unknown tool, or were cut off become ``invalid_tool_calls``.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages.tool import (
    InvalidToolCall,
    ToolCall,
    ToolCallChunk,
    invalid_tool_call,
    tool_call,
    tool_call_chunk,
)

from agent_mtp.engine.grammar import JSON_SEPARATORS, GrammarSpec, json_schema_ebnf
from agent_mtp.errors import ConfigError

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_BLOCK_OPEN = CALL_OPEN + "\n"
_BLOCK_CLOSE = "\n" + CALL_CLOSE
_BLOCK_RE = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_CHOICES = ("auto", "any", "none")


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model sees it (from an OpenAI-format tool)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        fn = tool.get("function", tool)
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ConfigError(f"A tool needs a function name; got {_short(tool)}. Pass tools through bind_tools().")
        name = fn["name"]
        if not _TOOL_NAME_RE.fullmatch(name):
            msg = (
                f"Tool name {name!r} is invalid: use 1-64 letters, digits, '_' or '-' (no spaces), as OpenAI does; "
                f"for example {re.sub(r'[^A-Za-z0-9_-]+', '_', name).strip('_')[:64] or 'my_tool'!r}."
            )
            raise ConfigError(msg)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            msg = (
                f"Tool {name!r} has parameters={_short(params)}: use a JSON schema of type 'object' "
                "(a dict such as {'type': 'object', 'properties': {...}})."
            )
            raise ConfigError(msg)
        return cls(name=name, description=str(fn.get("description") or ""), parameters=params)

    def prompt_entry(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}


def tool_specs(tools: Sequence[Mapping[str, Any]] | None) -> list[ToolSpec]:
    specs = [ToolSpec.from_openai(t) for t in tools or ()]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"Tool names must be unique; {duplicates} appear more than once.")
    return specs


def normalize_tool_choice(choice: Any, names: Sequence[str]) -> str | None:
    """None (unset), "auto", "any", "none" or a tool name. Accepts OpenAI/Anthropic spellings:
    "required", True, {"type": "function", "function": {"name": ...}}, {"type": "tool", "name": ...}."""
    if choice is None:
        return None
    if choice is True or choice == "required":
        return "any"
    if choice is False:
        return "none"
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind in TOOL_CHOICES:
            return str(kind)
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise ConfigError(f"tool_choice={choice!r} names no tool; use 'auto', 'any', 'none' or a tool name.")
        choice = name
    if not isinstance(choice, str):
        raise ConfigError(f"tool_choice={choice!r} is invalid; use None, 'auto', 'any', 'none' or a tool name.")
    if choice in TOOL_CHOICES:
        return choice
    if choice not in names:
        raise ConfigError(f"tool_choice={choice!r} is not a bound tool; the tools are {list(names)}.")
    return choice


# ------------------------------------------------------------------------------------------------ prompt
def render_tool_call(name: str, args: Mapping[str, Any]) -> str:
    """One call in the model's syntax (for the history and for examples)."""
    payload = json.dumps({"name": name, "arguments": dict(args)}, ensure_ascii=False, separators=JSON_SEPARATORS)
    return f"{_BLOCK_OPEN}{payload}{_BLOCK_CLOSE}"


def tools_system_block(specs: Sequence[ToolSpec], tool_choice: str | None = None, *, parallel: bool = False) -> str:
    """The documented system-prompt block that describes the tools and the call syntax to the model.

    The service renders it with ``tool_choice=None`` whatever the request's choice (the grammar enforces the
    choice), so every step of an agent starts with the same tokens and the engine's prefix cache reads them once;
    a one-off prompt may name the choice (``"any"`` or a tool name adds "You must call ... now.")."""
    listing = "\n".join(json.dumps(s.prompt_entry(), ensure_ascii=False) for s in specs)
    example_name = specs[0].name if len(specs) == 1 else "<tool name>"
    lines = [
        "You can call tools. The tools, as JSON schemas:",
        f"<tools>\n{listing}\n</tools>",
        "To call a tool, reply with exactly this and nothing after it:",
        f'{_BLOCK_OPEN}{{"name": "{example_name}", "arguments": {{<arguments as JSON>}}}}{_BLOCK_CLOSE}',
        _choice_instruction(tool_choice),
    ]
    if parallel:
        lines.append("You may call several tools: one <tool_call> block per call.")
    lines.append("A tool's result comes back in a message from the tool; then answer the user with it.")
    return "\n".join(lines)


def _choice_instruction(tool_choice: str | None) -> str:
    if tool_choice == "any":
        return "You must call one of the tools now."
    if tool_choice not in (None, "auto", "none"):
        return f"You must call the tool {tool_choice} now."
    return "Call a tool when you need its result to answer; otherwise answer the user directly."


# ------------------------------------------------------------------------------------------------ grammar
def call_schema(specs: Sequence[ToolSpec]) -> dict[str, Any]:
    """JSON schema of one call object {"name": ..., "arguments": ...} over ``specs`` ($defs hoisted to the root)."""
    defs: dict[str, Any] = {}
    cases = []
    for spec in specs:
        params = _hoist_defs(spec.parameters, spec.name, defs)
        if not params.get("type") and "properties" in params:
            params["type"] = "object"
        cases.append(
            {
                "type": "object",
                "properties": {"name": {"const": spec.name}, "arguments": params},
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = cases[0] if len(cases) == 1 else {"anyOf": cases}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def tool_call_grammar(
    specs: Sequence[ToolSpec],
    tool_choice: str | None,
    *,
    parallel: bool = False,
    answer_schema: Mapping[str, Any] | None = None,
) -> GrammarSpec | None:
    """The grammar for a generation with ``specs`` bound (see the module docstring)."""
    if not specs:
        return None
    if tool_choice == "none":
        fmt_none = {"type": "any_text", "excludes": [CALL_OPEN]}
        return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt_none})
    forced = tool_choice not in (None, "auto")
    chosen = [s for s in specs if s.name == tool_choice] if forced and tool_choice != "any" else list(specs)
    tag = {
        "type": "tag",
        "begin": _BLOCK_OPEN,
        "content": {"type": "grammar", "grammar": json_schema_ebnf(call_schema(chosen))},
        "end": _BLOCK_CLOSE,
    }
    calls = {"type": "tags_with_separator", "tags": [tag], "separator": "\n", "at_least_one": True,
             "stop_after_first": not parallel}  # fmt: skip
    if forced:
        fmt: dict[str, Any] = calls
    elif answer_schema is not None:
        answer = {"type": "grammar", "grammar": json_schema_ebnf(answer_schema)}
        fmt = {"type": "or", "elements": [calls, answer]}
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_OPEN], "tags": [tag], "at_least_one": False,
               "stop_after_first": not parallel}  # fmt: skip
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": fmt})


def _hoist_defs(schema: Mapping[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """Copy ``schema`` with its local $defs/definitions moved into ``defs`` under ``<prefix>__<name>``."""
    out = copy.deepcopy(dict(schema))
    local: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, sub in (out.pop(key, None) or {}).items():
            local[f"#/{key}/{name}"] = f"{prefix}__{name}"
            defs[f"{prefix}__{name}"] = sub

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref in local:
                node = {**node, "$ref": f"#/$defs/{local[ref]}"}
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name in [local[r] for r in local]:
        defs[name] = rewrite(defs[name])
    return rewrite(out)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ parsing
@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, specs: Sequence[ToolSpec]) -> ParsedOutput:
    """Split model text into content and tool calls (complete blocks) / invalid tool calls (the rest)."""
    by_name = {s.name: s for s in specs}
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    outside: list[str] = []
    position = 0
    for match in _BLOCK_RE.finditer(text):
        outside.append(text[position : match.start()])
        position = match.end()
        call, bad = parse_call_body(match.group(1), by_name)
        if call is not None:
            calls.append(call)
        if bad is not None:
            invalid.append(bad)
    rest = text[position:]
    cut = rest.find(CALL_OPEN)
    if cut >= 0:
        outside.append(rest[:cut])
        body = rest[cut + len(CALL_OPEN) :]
        invalid.append(_invalid(body, "The tool call was cut off before </tool_call> (raise max_tokens)."))
    else:
        outside.append(rest)
    return ParsedOutput("".join(outside).strip(), calls, invalid)


def parse_call_body(body: str, by_name: Mapping[str, ToolSpec]) -> tuple[ToolCall | None, InvalidToolCall | None]:
    """One block's JSON -> (tool call, None) or (None, invalid tool call)."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as e:
        return None, _invalid(body, f"The tool call is not valid JSON: {e.msg} at char {e.pos}.")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None, _invalid(body, 'A tool call must be a JSON object {"name": ..., "arguments": {...}}.')
    name = payload["name"]
    args = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None, _invalid(body, f"The arguments of {name} are a string that is not JSON.", name=name)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None, _invalid(body, f"The arguments of {name} must be a JSON object.", name=name)
    spec = by_name.get(name)
    if spec is None:
        return None, _invalid(body, f"Unknown tool {name!r}; the tools are {sorted(by_name)}.", name=name)
    return tool_call(name=name, args=coerce_arguments(args, spec.parameters), id=new_call_id()), None


def _invalid(body: str, error: str, *, name: str | None = None) -> InvalidToolCall:
    if name is None:
        found = _NAME_RE.search(body)
        name = json.loads(f'"{found.group(1)}"') if found else None
    return invalid_tool_call(name=name, args=body.strip(), id=new_call_id(), error=error)


# ------------------------------------------------------------------------------------------------ coercion
def coerce_arguments(args: Mapping[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments with values converted to the schema's types where that is lossless ("3" -> 3, "true" -> True)."""
    value = _coerce(dict(args), schema, schema)
    return value if isinstance(value, dict) else dict(args)


def _coerce(value: Any, schema: Any, root: Mapping[str, Any]) -> Any:
    if not isinstance(schema, Mapping):
        return value
    schema = _resolve(schema, root)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _coerce_union(value, schema[key], root)
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return _coerce(value, schema["allOf"][0], root)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _coerce_union(value, [{**schema, "type": k} for k in kind], root)
    if kind == "object" or (kind is None and "properties" in schema):
        return _coerce_object(value, schema, root)
    if kind == "array":
        return _coerce_array(value, schema, root)
    return _coerce_scalar(value, kind)


def _coerce_object(value: Any, schema: Mapping[str, Any], root: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        value = _json_or(value, value)
    if not isinstance(value, dict):
        return value
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    return {k: _coerce(v, props.get(k, extra if isinstance(extra, Mapping) else {}), root) for k, v in value.items()}


def _coerce_array(value: Any, schema: Mapping[str, Any], root: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        value = _json_or(value, value)
    if not isinstance(value, list):
        return value
    return [_coerce(v, schema.get("items", {}), root) for v in value]


def _coerce_scalar(value: Any, kind: Any) -> Any:
    if kind == "integer":
        return _to_int(value)
    if kind == "number":
        return _to_number(value)
    if kind == "boolean" and isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return json.dumps(value)
    if kind == "null" and isinstance(value, str) and value.strip().lower() in ("null", "none"):
        return None
    return value


def _coerce_union(value: Any, options: Sequence[Any], root: Mapping[str, Any]) -> Any:
    resolved = [_resolve(o, root) if isinstance(o, Mapping) else {} for o in options]
    if any(_matches_type(value, o) for o in resolved):
        match = next(o for o in resolved if _matches_type(value, o))
        return _coerce(value, match, root)
    for option in resolved:
        coerced = _coerce(value, option, root)
        if _matches_type(coerced, option):
            return coerced
    return value


def _matches_type(value: Any, schema: Mapping[str, Any]) -> bool:
    kind = schema.get("type")
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if isinstance(kind, str) and kind in checks:
        return bool(checks[kind](value))
    if "const" in schema:
        return bool(value == schema["const"])
    if "enum" in schema:
        return value in schema["enum"]
    return kind is None and "properties" not in schema


def _to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if re.fullmatch(r"[+-]?\d+\.0*", text):
            return int(float(text))
    return value


def _to_number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return value
        return int(number) if number.is_integer() and re.fullmatch(r"[+-]?\d+", value.strip()) else number
    return value


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    seen = 0
    while isinstance(schema.get("$ref"), str) and seen < 32:
        ref = schema["$ref"]
        if not ref.startswith("#/"):
            return schema
        node: Any = root
        for part in ref[2:].split("/"):
            node = node.get(part, {}) if isinstance(node, Mapping) else {}
        schema = node if isinstance(node, Mapping) else {}
        seen += 1
    return schema


def _json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return default


# ------------------------------------------------------------------------------------------------ validation
def validation_errors(text: str, specs: Sequence[ToolSpec], *, require_call: bool) -> list[str]:
    """Problems with the tool calls in ``text`` (unparsable blocks, schema violations), for a quality monitor."""
    import jsonschema

    parsed = parse_tool_calls(text, specs)
    errors = [f"{bad.get('name') or 'tool call'}: {bad.get('error')}" for bad in parsed.invalid_tool_calls]
    if require_call and not parsed.tool_calls and not errors:
        errors.append("a tool call was required but the output has none")
    by_name = {s.name: s for s in specs}
    for call in parsed.tool_calls:
        schema = dict(by_name[call["name"]].parameters)
        checker = jsonschema.validators.validator_for(schema)(schema)
        problem = next(iter(checker.iter_errors(call["args"])), None)
        if problem is not None:
            where = "/".join(str(p) for p in problem.absolute_path) or "<arguments>"
            errors.append(f"{call['name']}: {where}: {problem.message}")
    return errors


# ------------------------------------------------------------------------------------------------ streaming
@dataclass
class StreamDelta:
    content: str = ""
    tool_call_chunks: list[ToolCallChunk] = field(default_factory=list)


class ToolCallStream:
    """Incremental :func:`parse_tool_calls` for streaming: feed text deltas, get content deltas and one
    complete tool-call chunk per closed ``<tool_call>`` block. A call is emitted only once it is whole, so a
    cut-off call never shows up as a partial tool call. An invalid call (cut off, not JSON, unknown tool) is
    emitted as a chunk whose ``args`` is the raw model text (it starts with ``<tool_call>``, so it never
    parses): LangChain's chunk aggregation turns it into an ``invalid_tool_calls`` entry, the only way a
    stream can carry one. The concatenated content equals ``parse_tool_calls(...).content``."""

    def __init__(self, specs: Sequence[ToolSpec]) -> None:
        self.by_name = {s.name: s for s in specs}
        self._buffer = ""
        self._in_call = False
        self._held_space = ""
        self._started = False
        self._index = 0

    def feed(self, text: str) -> StreamDelta:
        self._buffer += text
        out = StreamDelta()
        while True:
            if self._in_call:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return out
                self._emit_call(self._buffer[:end], out)
                self._buffer = self._buffer[end + len(CALL_CLOSE) :]
                self._in_call = False
                continue
            start = self._buffer.find(CALL_OPEN)
            if start >= 0:
                out.content += self._content(self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buffer, CALL_OPEN)
            out.content += self._content(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._in_call:
            self._emit_invalid(_invalid(self._buffer, "cut off"), out)
        else:
            out.content += self._content(self._buffer)
        self._buffer = ""
        return out

    def _content(self, text: str) -> str:
        """Content with the leading and trailing whitespace of the whole message removed (as in invoke)."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = text[len(stripped) :]
        return stripped

    def _emit_call(self, body: str, out: StreamDelta) -> None:
        call, bad = parse_call_body(body, self.by_name)
        if call is not None:
            args = json.dumps(call["args"], ensure_ascii=False)
            out.tool_call_chunks.append(tool_call_chunk(name=call["name"], args=args, id=call["id"], index=self._index))
            self._index += 1
        if bad is not None:
            self._emit_invalid(bad, out)

    def _emit_invalid(self, bad: InvalidToolCall, out: StreamDelta) -> None:
        raw = CALL_OPEN + "\n" + (bad.get("args") or "")
        out.tool_call_chunks.append(
            tool_call_chunk(name=bad.get("name"), args=raw, id=bad.get("id"), index=self._index)
        )
        self._index += 1


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _short(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
