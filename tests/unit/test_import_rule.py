"""Imports point one way: the engine knows nothing of the policy, telemetry, the service, LangChain, Redis, YAML
or HTTP (checked on the source, so a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
from pathlib import Path

import agent_mtp.engine

ENGINE = Path(agent_mtp.engine.__file__).parent
FORBIDDEN = (
    "agent_mtp.policy",
    "agent_mtp.telemetry",
    "agent_mtp.service",
    "agent_mtp.langchain",
    "agent_mtp.server",
    "agent_mtp.bench",
    "agent_mtp.training",
    "agent_mtp.cli",
    "agent_mtp.tools",
    "langchain",
    "langchain_core",
    "langgraph",
    "redis",
    "yaml",
    "httpx",
    "fastapi",
    "starlette",
    "requests",
)


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.append(node.module)
    return names


def test_the_engine_imports_nothing_from_the_layers_above_it() -> None:
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 10
    bad = [
        f"{path.relative_to(ENGINE.parent)} imports {name}"
        for path in files
        for name in imported_modules(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not bad, "the engine must not import these (see docs/architecture.md):\n" + "\n".join(bad)
