"""Grammar-constrained decoding with xgrammar: a :class:`~agent_mtp.engine.constraints.TokenConstraint` that
keeps every accepted token inside a grammar (a JSON schema, an EBNF grammar or an xgrammar structural tag).

    grammar = compile_grammar(engine.tokenizer, GrammarSpec.json_schema(schema),
                              vocab_size=engine.vocab_size, stop_token_ids=engine.eos_token_ids)
    result = engine.generate(prompt, config, constraint=grammar.constraint())

How the decode loop uses it (see ``engine/decode.py``): position 1 of every pass is picked from
:meth:`GrammarConstraint.allowed_mask`; the other proposals of the pass are offered to
:meth:`GrammarConstraint.accept` and the block is cut at the first token the grammar rejects;
:meth:`GrammarConstraint.rollback` undoes proposals that acceptance did not keep;
:meth:`GrammarConstraint.forced_tokens` gives the jump-forward tokens.

Jump-forward and exactness. Where the grammar admits exactly one continuation string (keys, quotes, braces, a
forced tool name), xgrammar's jump-forward string is re-tokenised with the model's tokenizer and its last
token is dropped (it may merge with what follows); the tokens the matcher accepts become the state's *plan*. A
plan is a function of the decoding state alone: at a state with a plan only the plan's next token is allowed,
whether it is appended by jump-forward or chosen by the model inside a multi-token pass. So the token sequence
does not depend on where the pass boundaries fall, and constrained ``verified`` output equals constrained
``ntp`` output token for token, with jump-forward on. A state where the grammar allows a single token (often
the end-of-sequence token after a closed tool call) plans that token.

Special tokens (``<|im_start|>``, the MTP mask token, ...) are never allowed: xgrammar treats an added token's
text as ordinary bytes, so a JSON string would otherwise admit them. End-of-sequence tokens are allowed
exactly where the grammar is complete.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from agent_mtp.engine.threads import single_threaded
from agent_mtp.errors import GrammarError

GrammarKind = Literal["json_schema", "json_object", "ebnf", "structural_tag"]
_CACHE_SIZE = 256
_ENCODED_SIZE = 4096
"""Forced strings whose token ids a vocabulary remembers (:meth:`_Vocab.encode`)."""
_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to, as a hashable value (the compile cache key).

    ``source`` is a JSON schema as JSON text (keys in their given order: property order is the order the grammar
    enforces, so it must not be sorted), an EBNF grammar, or an xgrammar structural tag as JSON.
    """

    kind: GrammarKind
    source: str = ""
    strict: bool = True
    """JSON schema only: forbid properties and items the schema does not name."""

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, *, strict: bool = True) -> GrammarSpec:
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text, strict)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (JSON mode)."""
        return cls("json_object")

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: Mapping[str, Any] | str) -> GrammarSpec:
        text = tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False)
        return cls("structural_tag", text)


JSON_SEPARATORS = (", ", ": ")
"""The one JSON layout every schema grammar here uses: ``json.dumps``'s default, on one line. One fixed layout
means long jump-forward strings; this one is what small models read and write best (after ``"input": `` the
default model copies a number from the question, after the compact ``"input":`` it opens a nested object)."""


def json_schema_ebnf(schema: Mapping[str, Any], *, strict: bool = True) -> str:
    """The EBNF of a JSON schema in the :data:`JSON_SEPARATORS` layout (to embed it in a larger grammar)."""
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(
            json.dumps(schema, ensure_ascii=False),
            any_whitespace=False,
            separators=JSON_SEPARATORS,
            strict_mode=strict,
        )
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(f"Cannot convert the JSON schema to a grammar: {e}. Schema: {_short(schema)}") from e
    return str(grammar)


# --------------------------------------------------------------------------------------------- vocabulary
class _Vocab:
    """xgrammar's view of one tokenizer at one logits width, plus the tokens that are never allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        try:
            self.info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
            )
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(f"xgrammar cannot read the tokenizer {type(tokenizer).__name__}: {e}") from e
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        banned = _banned_tokens(tokenizer, vocab_size, stop_token_ids)  # [V] bool
        self.banned_ids = frozenset(int(i) for i in banned.nonzero().flatten().tolist())
        self.allowed_words = _pack(~banned)
        """int32 [ceil(V/32)]: the tokens that may ever be allowed, in xgrammar's bitmask layout."""
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._encoded: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def encode(self, text: str) -> tuple[int, ...]:
        """``text`` as token ids (no special tokens), remembered for the last :data:`_ENCODED_SIZE` texts. A grammar's
        forced strings recur (a schema's keys, a tool call's opening), and the tokenizer's ``encode`` runs in
        Python twice a constrained pass (the plan and the forced draft): under 8 clients in one process it was a
        third of ``verified``'s Python between passes (py-spy), time every other sequence's next pass waits for."""
        with self._lock:
            ids = self._encoded.get(text)
            if ids is not None:
                self._encoded.move_to_end(text)
                return ids
        ids = tuple(int(t) for t in self.tokenizer.encode(text, add_special_tokens=False))
        with self._lock:
            self._encoded[text] = ids
            while len(self._encoded) > _ENCODED_SIZE:
                self._encoded.popitem(last=False)
        return ids

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        compiled = self._compile(spec)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(
                    spec.source, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=spec.strict
                )
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
                )
            if spec.kind == "ebnf":
                return self.compiler.compile_grammar(spec.source)
            if spec.kind == "structural_tag":
                return self.compiler.compile_structural_tag(spec.source)
        except (RuntimeError, ValueError, TypeError) as e:
            msg = f"Cannot compile the {spec.kind} grammar: {e}. Grammar: {spec.source[:300]!r}"
            raise GrammarError(msg + " Check the schema (a JSON schema object) or grammar syntax.") from e
        raise GrammarError(f"Unknown grammar kind {spec.kind!r}; use json_schema, json_object, ebnf or structural_tag.")


def _banned_tokens(tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Special/added-special tokens (except the stop tokens) and rows the tokenizer does not know."""
    banned = torch.zeros(vocab_size, dtype=torch.bool)
    special: set[int] = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    for token_id in special - set(stop_token_ids):
        if 0 <= token_id < vocab_size:
            banned[token_id] = True
    known = len(tokenizer) if hasattr(tokenizer, "__len__") else vocab_size
    if known < vocab_size:
        banned[known:] = True
    return banned


_VOCABS: dict[tuple[int, int, tuple[int, ...]], _Vocab] = {}
_VOCABS_LOCK = threading.Lock()


def _vocab(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> _Vocab:
    stops = tuple(sorted({int(t) for t in stop_token_ids}))
    if not stops:
        raise GrammarError("A grammar needs at least one stop (end-of-sequence) token id; pass stop_token_ids.")
    key = (id(tokenizer), int(vocab_size), stops)
    with _VOCABS_LOCK:
        vocab = _VOCABS.get(key)
        if vocab is not None and vocab.tokenizer is tokenizer:
            return vocab
    with single_threaded():  # a one-off on a request thread: no OpenMP pool of its own (engine/threads.py)
        vocab = _Vocab(tokenizer, int(vocab_size), stops)
    with _VOCABS_LOCK:
        _VOCABS[key] = vocab
    return vocab


# --------------------------------------------------------------------------------------------- public API
class CompiledGrammar:
    """A grammar compiled for one tokenizer; :meth:`constraint` makes a fresh matcher per generation."""

    def __init__(self, vocab: _Vocab, spec: GrammarSpec, compiled: Any, *, jump_forward: bool) -> None:
        self.vocab = vocab
        self.spec = spec
        self.compiled = compiled
        self.jump_forward = jump_forward

    def constraint(self) -> GrammarConstraint:
        return GrammarConstraint(self.vocab, self.compiled, jump_forward=self.jump_forward)

    __call__ = constraint
    """A CompiledGrammar is itself a constraint factory (``constraint_factory=grammar``)."""


def compile_grammar(
    tokenizer: Any,
    spec: GrammarSpec,
    *,
    vocab_size: int,
    stop_token_ids: Iterable[int],
    jump_forward: bool = True,
) -> CompiledGrammar:
    """Compile ``spec`` for ``tokenizer`` (cached per tokenizer, logits width, stop tokens and spec).

    ``vocab_size`` is the width of the model's logits (embedding rows), which may exceed the tokenizer's
    vocabulary (the MTP mask token is an extra row); rows past the tokenizer's vocabulary are never allowed.
    """
    vocab = _vocab(tokenizer, vocab_size, stop_token_ids)
    return CompiledGrammar(vocab, spec, vocab.compile(spec), jump_forward=jump_forward)


class GrammarConstraint:
    """An xgrammar matcher behind the :class:`~agent_mtp.engine.constraints.TokenConstraint` protocol."""

    def __init__(self, vocab: _Vocab, compiled: Any, *, jump_forward: bool = True) -> None:
        import xgrammar as xgr

        self.vocab = vocab
        self.matcher = xgr.GrammarMatcher(compiled)
        self.jump_forward = jump_forward
        self._bitmask = xgr.allocate_token_bitmask(1, vocab.vocab_size)
        self._bits: np.ndarray = self._bitmask[0].numpy()  # the same memory, read without torch's per-op cost
        self._filled = False
        """Whether ``_bits`` holds the current state's allowed tokens."""
        self._plans: list[tuple[int, ...] | None] = [None]
        """The plan (forced tokens) of the state after each accepted token; None = not computed yet."""
        self._mask: torch.Tensor | None = None
        """Allowed tokens of the current state (cached until the state changes)."""
        self._terminated: bool | None = None
        """Whether the matcher has terminated, asked once per state (None: not yet). xgrammar's matcher methods
        release the GIL, so beside other busy threads (a batched server's decode steps) each call waits to get it
        back: ``is_terminated`` 0.16 us alone, 51 us beside one spinning thread; a constrained step asked it ~5
        times."""
        self._forced: tuple[int, tuple[int, ...]] | None = None
        """The current state's forced text: (its tokens' count, the longest prefix of them the matcher accepts),
        worked out once per state for both the jump-forward plan and the forced draft (each token tried is a
        matcher call, as above)."""

    # -- TokenConstraint ------------------------------------------------------------------------------------
    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        plan = self._plan()
        if plan:
            mask = torch.zeros(self.vocab.vocab_size, dtype=torch.bool)
            mask[plan[0]] = True
        else:
            mask = self._grammar_mask()
        return _fit(mask, vocab_size)

    def never_allows(self, token_id: int) -> bool:
        """Whether ``token_id`` is never allowed, in any state (special tokens other than the stop tokens, rows the
        tokenizer does not know): its logit need not be masked out for this constraint's sake."""
        return token_id in self.vocab.banned_ids or not 0 <= token_id < self.vocab.vocab_size

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` is allowed next: ``allowed_mask(...)[token_id]`` without building the mask (a bit
        of xgrammar's bitmask; the decode loop asks this of the greedy token, on every constrained pass)."""
        plan = self._plan()
        if plan:
            return token_id == plan[0]
        if not 0 <= token_id < self.vocab.vocab_size:
            return False
        return bool((int(self._fill()[token_id >> 5]) >> (token_id & 31)) & 1)

    def accept(self, token_id: int) -> bool:
        token_id = int(token_id)
        if token_id in self.vocab.banned_ids or not 0 <= token_id < self.vocab.vocab_size:
            return False
        if self.is_terminated():
            return False
        plan = self._plan()
        if plan and token_id != plan[0]:
            return False
        if not self.matcher.accept_token(token_id):
            return False
        self._plans.append(plan[1:] or None)
        self._forget_state()
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._plans) - 1:
            raise GrammarError(f"Cannot roll back {num_tokens} tokens: only {len(self._plans) - 1} were accepted.")
        self.matcher.rollback(num_tokens)
        del self._plans[-num_tokens:]
        self._forget_state()

    def is_terminated(self) -> bool:
        if self._terminated is None:
            self._terminated = bool(self.matcher.is_terminated())
        return self._terminated

    def forced_tokens(self) -> list[int]:
        return list(self._plan())

    def forced_draft(self) -> list[int]:
        """The whole forced text as tokens, its last token included (see :meth:`_jump_forward_tokens`): a draft for
        verified decoding, which checks it against the model instead of appending it. After a jump forward this is
        typically the one token it left out, e.g. the `` "`` that opens a string value after a forced key, which
        otherwise costs a pass of its own. Does not advance the state."""
        return [] if self.is_terminated() else list(self._forced_text()[1])

    # -- extras -----------------------------------------------------------------------------------------------
    def is_completed(self) -> bool:
        """True when the tokens so far form a complete match (the stop token may still follow)."""
        return bool(self.matcher.is_completed())

    @property
    def num_accepted(self) -> int:
        return len(self._plans) - 1

    # -- internals ------------------------------------------------------------------------------------------
    def _forget_state(self) -> None:
        self._mask = self._terminated = self._forced = None
        self._filled = False

    def _fill(self) -> np.ndarray:
        """The current state's allowed tokens as a packed bitmask (banned tokens cleared), filled once per state."""
        if not self._filled:
            if self.is_terminated():
                self._bits.fill(0)
            else:
                self.matcher.fill_next_token_bitmask(self._bitmask)
                np.bitwise_and(self._bits, self.vocab.allowed_words, out=self._bits)
            self._filled = True
        return self._bits

    def _grammar_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = _unpack(torch.from_numpy(self._fill()), self.vocab.vocab_size)
        return self._mask

    def _single_token(self) -> int | None:
        """The one allowed token, if exactly one is (a word with a single bit set, all others zero)."""
        bits = self._fill()
        words = np.flatnonzero(bits)
        if len(words) != 1:
            return None
        word = int(bits[words[0]]) & 0xFFFFFFFF
        return int(words[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None

    def _plan(self) -> tuple[int, ...]:
        plan = self._plans[-1]
        if plan is None:
            plan = self._compute_plan() if self.jump_forward else ()
            self._plans[-1] = plan
        return plan

    def _compute_plan(self) -> tuple[int, ...]:
        if self.is_terminated():
            return ()
        tokens = self._jump_forward_tokens()
        if tokens:
            return tokens
        single = self._single_token()  # a single legal token (e.g. the stop token after a closed tool call)
        return () if single is None else (single,)

    def _jump_forward_tokens(self) -> tuple[int, ...]:
        """Tokens of the forced string that the matcher accepts, minus the last token of the tokenisation (it
        could merge with the text that follows): the accepted prefix of all but the last token is the accepted
        prefix of all of them cut there. The matcher is left where it was."""
        count, accepted = self._forced_text()
        return accepted[: max(count - 1, 0)]

    def _forced_text(self) -> tuple[int, tuple[int, ...]]:
        """(how many tokens the forced string encodes to, the longest prefix of them the matcher accepts)."""
        if self._forced is None:
            forced = self.matcher.find_jump_forward_string()
            ids = self.vocab.encode(forced) if forced else ()
            self._forced = (len(ids), self._accepted_prefix(ids))
        return self._forced

    def _accepted_prefix(self, ids: Sequence[int]) -> tuple[int, ...]:
        """The longest prefix of ``ids`` that the matcher accepts; the matcher is left where it was."""
        taken = 0
        for token_id in ids:
            if token_id in self.vocab.banned_ids or not self.matcher.accept_token(int(token_id)):
                break
            taken += 1
        if taken:
            self.matcher.rollback(taken)
        return tuple(int(t) for t in ids[:taken])


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [ceil(V/32)] bitmask -> bool [V] (bit i of word w is token 32 * w + i)."""
    bits = (bitmask[:, None] >> _SHIFTS) & 1  # [W, 32]
    return bits.flatten()[:vocab_size].bool()


def _pack(mask: torch.Tensor) -> np.ndarray:
    """bool [V] -> int32 [ceil(V/32)] in xgrammar's bitmask layout (the inverse of :func:`_unpack`)."""
    words = -(-mask.shape[0] // 32)
    padded = torch.zeros(words * 32, dtype=torch.int64)
    padded[: mask.shape[0]] = mask.to(torch.int64)
    packed = (padded.view(words, 32) << _SHIFTS.to(torch.int64)).sum(1)  # [W] in 0 .. 2^32 - 1
    return packed.numpy().astype(np.uint32).view(np.int32)


def _fit(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if mask.shape[0] == vocab_size:
        return mask
    if mask.shape[0] > vocab_size:
        return mask[:vocab_size]
    return torch.cat([mask, torch.zeros(vocab_size - mask.shape[0], dtype=torch.bool)])


def _short(value: Any, limit: int = 200) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def compile_for_engine(engine: Any, spec: GrammarSpec, *, jump_forward: bool = True) -> CompiledGrammar:
    """:func:`compile_grammar` with the tokenizer, logits width and stop tokens of an :class:`MTPEngine`."""
    head = engine.model.get_output_embeddings()
    width = int(head.weight.shape[0]) if head is not None else int(engine.model.config.vocab_size)
    return compile_grammar(
        engine.tokenizer,
        spec,
        vocab_size=width,
        stop_token_ids=engine.eos_token_ids,
        jump_forward=jump_forward,
    )
