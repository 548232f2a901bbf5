"""Step classification: which step type a generation is, decided from the agent context by the policy's rules."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_mtp.policy.schema import ClassificationRule, Policy, RuleCondition

_ROLE_ALIASES = {"human": "user", "ai": "assistant", "function": "tool"}
_RESERVED_CHOICES = {"auto", "none", "any"}


@dataclass(frozen=True)
class StepContext:
    """What the caller (the chat model) knows about one generation, filled from the LangChain call.

    Roles may be given in LangChain's words (human, ai) or OpenAI's (user, assistant); both are accepted.
    ``tool_choice`` is None (not given), "auto", "none", "any" ("required" is read as "any") or a tool name.
    """

    step_type: str | None = None
    """Explicit step type from the call's config/metadata; wins over every rule."""
    tools_bound: bool = False
    tool_choice: str | None = None
    structured_output: bool = False
    """True when the caller asked for structured output (with_structured_output / a response schema)."""
    last_role: str | None = None
    """Role of the last message: system, user, assistant or tool."""
    num_messages: int = 0
    tool_names: tuple[str, ...] = field(default=())
    run_id: str | None = None
    """Carried into the step event (e.g. the LangChain run id)."""

    def __post_init__(self) -> None:
        if self.last_role is not None:
            object.__setattr__(self, "last_role", _ROLE_ALIASES.get(self.last_role, self.last_role))
        if self.tool_choice == "required":
            object.__setattr__(self, "tool_choice", "any")
        if not isinstance(self.tool_names, tuple):
            object.__setattr__(self, "tool_names", tuple(self.tool_names))
        if self.tool_names and not self.tools_bound:
            object.__setattr__(self, "tools_bound", True)

    @property
    def tool_choice_kind(self) -> str:
        """unset, none, auto, any or named (a specific tool was forced)."""
        if self.tool_choice is None:
            return "unset"
        return self.tool_choice if self.tool_choice in _RESERVED_CHOICES else "named"


@dataclass(frozen=True)
class Classification:
    step_type: str
    reason: str
    """explicit, rule <i> (<name>) or default; shown in the response metadata."""


def classify(policy: Policy, context: StepContext) -> Classification:
    """Explicit step type first, then the first matching rule in order, then the policy's default."""
    if context.step_type:
        return Classification(context.step_type, "explicit")
    for i, rule in enumerate(policy.classification.rules):
        if matches(rule.when, context):
            return Classification(rule.step_type, _rule_label(i, rule))
    return Classification(policy.classification.default, "default")


def matches(when: RuleCondition, ctx: StepContext) -> bool:
    """True when every condition that is set holds for ``ctx``."""
    checks = (
        when.tools_bound is None or when.tools_bound == ctx.tools_bound,
        when.tool_choice is None or ctx.tool_choice_kind in when.tool_choice,
        when.structured_output is None or when.structured_output == ctx.structured_output,
        when.last_role is None or ctx.last_role in when.last_role,
        when.min_messages is None or ctx.num_messages >= when.min_messages,
        when.max_messages is None or ctx.num_messages <= when.max_messages,
        when.tool_names is None or any(name in ctx.tool_names for name in when.tool_names),
    )
    return all(checks)


def _rule_label(index: int, rule: ClassificationRule) -> str:
    return f"rule {index} ({rule.name})" if rule.name else f"rule {index}"
