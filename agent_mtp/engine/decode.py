"""The decode loop: one forward pass per iteration, k proposals per pass, acceptance by mode.

Each pass feeds ``pending + draft + masks``:

* ``pending``  accepted tokens not yet in the KV cache (the whole prompt on the first pass),
* ``draft``    tokens proposed for verification (verified mode only: the previous pass's mask predictions, or a
               prompt-lookup n-gram),
* ``masks``    k - 1 mask tokens; the logits at the last real token predict token 1, the logits at mask j predict
               token j + 1.

After the pass, mask positions and rejected draft positions are cropped from the cache; the newly chosen tokens
become ``pending`` for the next pass.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch

from agent_mtp.engine.acceptance import (
    accept_or_resample,
    confadapt_accept_length,
    pick,
    probabilities,
    top_probabilities,
)
from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.cost import PassTimes
from agent_mtp.engine.drafts import Draft, DraftSource, MTPDraftSource, NgramDraftSource
from agent_mtp.engine.planner import FUTURE_CREDIT, Plan, Planner
from agent_mtp.engine.results import DecodeStats, FinishReason, StreamChunk
from agent_mtp.engine.runner import GreedyRunRunner, Runner
from agent_mtp.engine.text import TextTracker
from agent_mtp.engine.threads import single_threaded

GREEDY_RUN = 4
"""Plain greedy passes (unconstrained, greedy: every ``ntp`` step, and ``verified`` ones where no draft could pay) a
fast runner chains without returning to the loop: the sequence's Python step and wake-up happen once per run instead
of once per pass (between two batched passes every sequence's step runs in turn under the GIL, and the pass waits
for the last; alone, each pass is handed to the compute thread and back). Output is the same token for token; the
stream's chunks arrive a run at a time, and a cancel or deadline takes effect within a run. 4 measured against 1
and 8 (8 clients in one process: 854.7 against 816.3 / 812.4 tokens/s); a run stays a few tens of milliseconds at 8
sequences."""


@dataclass
class DecodeSetup:
    """What the loop needs to know about the model, beyond the config."""

    mask_token_id: int
    eos_token_ids: frozenset[int]
    planner: Planner
    """Decides draft and masks of every pass (one per generation: it learns acceptance rates)."""
    coarse_masks: bool = False
    """``verified`` on a fast runner: compute the mask rows (only drafts) on an 8-bit grid where the runtime can."""
    pass_times: PassTimes | None = None
    """Where the loop records how long its passes took and whose :meth:`PassTimes.calibrated` curve the planner
    plans on (a sequence decoding alone; None beside others, whose runner prices its shared passes itself)."""


@dataclass
class _PassResult:
    new_tokens: list[int]
    source: str
    proposed_beyond_first: int = 0
    accepted_beyond_first: int = 0


@dataclass
class _State:
    pending: list[int]
    context: list[int]
    """prompt + everything accepted (for n-gram lookup)."""
    out: list[int] = field(default_factory=list)
    mtp: MTPDraftSource = field(default_factory=MTPDraftSource)
    sources: list[DraftSource] = field(default_factory=list)
    """Draft sources asked before every verified pass (MTP first, then prompt lookup)."""


def decode(
    runner: Runner,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    setup: DecodeSetup,
    tracker: TextTracker,
    *,
    constraint: TokenConstraint | None = None,
    started_at: float | None = None,
) -> Iterator[StreamChunk]:
    """Yield one :class:`StreamChunk` per forward pass; the last carries finish_reason and stats.

    A runner that already holds a prefix of ``prompt_ids`` (restored from the prefix cache) prefills only the rest.
    ``started_at``: the ``time.perf_counter()`` the caller's clock started (TTFT and wall time count from it)."""
    start = time.perf_counter() if started_at is None else started_at
    cached = runner.length
    if cached >= len(prompt_ids):
        raise ValueError(f"The runner holds {cached} tokens of a {len(prompt_ids)}-token prompt; at most all but one.")
    stats = DecodeStats(mode=cfg.mode, prompt_tokens=len(prompt_ids), cached_prompt_tokens=cached)
    share_curve = getattr(runner, "share_curve", None)  # a runner whose passes are shared (engine/batching.py)
    if share_curve is not None:
        setup.pass_times = None  # its passes' times are the batch's, not this sequence's
        if setup.planner.curve is not None:
            setup.planner.curve = share_curve(setup.planner.curve)
    elif setup.pass_times is not None and setup.planner.curve is not None:
        setup.planner.curve = setup.pass_times.calibrated(setup.planner.curve)
    if hasattr(runner, "coarse_masks"):  # a fast runner: mask rows of a verified pass are only drafts
        runner.coarse_masks = cfg.mode == "verified" and setup.coarse_masks
    if hasattr(runner, "argmax_only"):  # a fast runner: greedy rows read only for their argmax (the runner's top)
        runner.argmax_only = cfg.mode in ("ntp", "verified") and cfg.temperature <= 0 and constraint is None
    generator = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else None
    state = _State(pending=list(prompt_ids[cached:]), context=list(prompt_ids))
    if cfg.mode == "verified":
        state.sources = _draft_sources(state, cfg)
    finish: FinishReason | None = None
    # greedy runs (_greedy_run) where the runner chains passes: ntp, and verified where no draft could pay
    # (and static / ConfAdapt with k_max="auto" where the planner's k is 1 until its next exploring pass)
    chains = isinstance(runner, GreedyRunRunner) and (cfg.mode in ("ntp", "verified") or setup.planner.auto_k)
    while finish is None:
        if cfg.max_time is not None and stats.forward_passes and time.perf_counter() - start >= cfg.max_time:
            finish = "timeout"
            stats.new_tokens, stats.wall_s = len(state.out), time.perf_counter() - start
            yield StreamChunk(text=tracker.finish(), token_ids=(), finish_reason="timeout", stats=stats)
            return
        budget = cfg.max_new_tokens - len(state.out)
        steps, watch = _greedy_run_steps(chains, state, cfg, setup, constraint, budget, stats)
        if steps:  # (``chains`` checked the runner's kind once: a runtime protocol check costs ~0.1 ms)
            greedy_runner = cast(GreedyRunRunner, runner)
            finish = yield from _greedy_run(greedy_runner, state, cfg, setup, tracker, steps, stats, start, watch)
            continue
        with single_threaded():  # the pass runs on the compute thread; sampling here (engine/threads.py)
            result = _one_pass(
                runner, state, cfg, setup, budget, constraint, generator, stats, plain_ruled_out=steps == 0
            )
            if stats.forward_passes == 1:
                stats.prefill_s = stats.ttft_s = time.perf_counter() - start
            count = len(result.new_tokens)
            stats.accept_histogram[count] = stats.accept_histogram.get(count, 0) + 1
            kept, finish, text = _append(state, result.new_tokens, cfg, setup, tracker, constraint)
            if finish is None and constraint is not None:
                jumped, finish, jumped_text = _jump_forward(state, cfg, setup, tracker, constraint)
                stats.jump_forward_tokens += len(jumped)
                kept, text = kept + jumped, text + jumped_text
        if finish is None and cfg.max_time is not None and time.perf_counter() - start >= cfg.max_time:
            finish = "timeout"
        if finish is not None:
            text += tracker.finish()
        stats.new_tokens, stats.wall_s = len(state.out), time.perf_counter() - start
        yield StreamChunk(
            text=text,
            token_ids=tuple(kept),
            source=result.source,
            finish_reason=finish,
            stats=stats if finish is not None else None,
        )


def _greedy_run_steps(
    chains: bool,
    state: _State,
    cfg: DecodeConfig,
    setup: DecodeSetup,
    constraint: TokenConstraint | None,
    budget: int,
    stats: DecodeStats,
) -> tuple[int | None, _NgramWatch | None]:
    """How many passes the next greedy run takes (:data:`GREEDY_RUN` at most, the token budget), and for a
    ``verified`` run what ends it early: a plain greedy step (no constraint, one pending token, after the prefill) on
    a runner that chains passes (``chains``): every such ``ntp`` step, a static / ConfAdapt one (``k_max="auto"``)
    where the planner's k is 1 up to its next exploring pass (:meth:`Planner.plain_k_run`), and a ``verified`` one
    where no draft could pay this pass (:func:`_plain_if_hopeless` without the prompt lookup, which has no match
    worth verifying now), up to the planner's next exploring pass, ended by the first token after which the lookup
    has one (the watch: alone, most passes of free text find none, and each paid a decode step in Python, ~0.45 ms a
    pass). 0 for a pass of the loop's own whose hopelessness was ruled out here, None where it was not asked."""
    plain = cfg.temperature <= 0 and constraint is None and len(state.pending) == 1
    if not (chains and plain and stats.forward_passes) or budget < 2:
        return None, None
    if cfg.mode == "ntp":
        return min(GREEDY_RUN, budget), None
    if cfg.mode != "verified":  # static / ConfAdapt: a run where the planner's k is 1 (0: the loop's own pass)
        return setup.planner.plain_k_run(min(GREEDY_RUN, budget)) or None, None
    watch = _ngram_watch(state, cfg, setup.planner, budget)
    if watch is not None and watch.matches():  # a draft worth verifying: the loop's own pass
        return 0, None
    if _plain_if_hopeless(state, cfg, setup.planner, budget, constraint, lookup=False) is None:
        return 0, None
    return setup.planner.plain_run(min(GREEDY_RUN, budget), budget - 1), watch


@dataclass
class _NgramWatch:
    """Ends a ``verified`` greedy run after the first token following which the prompt lookup has a match over at
    least ``min_match`` tokens (one whose drafts could pay: :meth:`Planner.could_pay` at its kind's rate); called
    with each token of the run on the thread that runs the passes."""

    source: NgramDraftSource
    context: list[int]
    min_match: int
    tail: list[int] = field(default_factory=list)

    def matches(self) -> bool:
        """Whether the context (and the run's tokens so far) ends in such a match now."""
        return self.source.match_length(self.context, self.tail) >= self.min_match

    def __call__(self, token: int) -> bool:
        self.tail.append(token)
        return self.matches()


def _ngram_watch(state: _State, cfg: DecodeConfig, planner: Planner, budget: int) -> _NgramWatch | None:
    """The watch for prompt-lookup drafts of a verified greedy run: the shortest match whose kind's acceptance rate
    could pay (one token, else two or more); None where no match could, or there is no lookup."""
    source = next((s for s in state.sources if isinstance(s, NgramDraftSource)), None)
    if source is None:
        return None
    rates = planner.rates
    for min_match, rate in ((1, rates.ngram_short), (2, rates.ngram)):
        if source.ngram_max >= min_match and planner.could_pay(1, rate, budget - 1):
            return _NgramWatch(source, state.context, min_match)
    return None


def _greedy_run(
    runner: GreedyRunRunner,
    state: _State,
    cfg: DecodeConfig,
    setup: DecodeSetup,
    tracker: TextTracker,
    steps: int,
    stats: DecodeStats,
    start: float,
    watch: _NgramWatch | None = None,
) -> Generator[StreamChunk, None, FinishReason | None]:
    """Up to ``steps`` plain greedy passes in one call to the runner, then each token as the loop takes it from a
    pass of its own: one chunk a token, the same stop rules (EOS, stop tokens, length, stop strings) and the
    deadline against the time its pass ended; the passes after a finishing token are dropped from the cache, which
    then holds what the loop's own passes would have left. Returns the finish reason, or None to go on."""
    with single_threaded():
        began = time.perf_counter()
        tokens, ended = runner.greedy_steps(
            state.pending[0], steps, setup.eos_token_ids | set(cfg.stop_token_ids), watch
        )
    if setup.pass_times is not None and tokens:  # one-token passes: the time a step of the run took
        setup.pass_times.record(1, 0, (ended[-1] - began) / len(tokens))
    if cfg.mode != "ntp" and len(tokens) < steps:  # ended early (the watch, a stop token): not all made
        setup.planner.unplanned(steps - len(tokens))
    for i, token in enumerate(tokens):
        stats.forward_passes += 1
        stats.k_used[1] = stats.k_used.get(1, 0) + 1
        stats.accept_histogram[1] = stats.accept_histogram.get(1, 0) + 1
        kept, finish, text = _append(state, [token], cfg, setup, tracker, None)
        state.pending = [token]
        if finish is None and cfg.max_time is not None and ended[i] - start >= cfg.max_time:
            finish = "timeout"
        if finish is not None:
            runner.drop(len(tokens) - 1 - i)  # fed after this token: not the output's
            text += tracker.finish()
        stats.new_tokens, stats.wall_s = len(state.out), time.perf_counter() - start
        yield StreamChunk(
            text=text,
            token_ids=tuple(kept),
            source="ntp",
            finish_reason=finish,
            stats=stats if finish is not None else None,
        )
        if finish is not None:
            return finish
    return None


def _one_pass(
    runner: Runner,
    state: _State,
    cfg: DecodeConfig,
    setup: DecodeSetup,
    budget: int,
    constraint: TokenConstraint | None,
    generator: torch.Generator | None,
    stats: DecodeStats,
    *,
    plain_ruled_out: bool = False,
) -> _PassResult:
    """One pass of the loop's own. ``plain_ruled_out``: :func:`_plain_if_hopeless` already said a draft could pay
    (in :func:`_greedy_run_steps`), so the planner asks the sources at once."""
    plan = None if plain_ruled_out else _plain_if_hopeless(state, cfg, setup.planner, budget, constraint)
    if plan is None:
        plan = setup.planner.plan(len(state.pending), _drafts(state, cfg, budget, constraint), budget)
    draft, masks = plan.draft, plan.masks
    draft_tokens = plan.draft_tokens
    feed = state.pending + draft_tokens + [setup.mask_token_id] * masks
    keep = len(draft_tokens) + masks + 1
    began = time.perf_counter()
    logits = runner.forward(feed, keep)  # [keep, V]: row 0 = last pending token
    if setup.pass_times is not None and stats.forward_passes:  # a decode pass (not the prefill)
        real, spent = len(state.pending) + len(draft_tokens), time.perf_counter() - began
        setup.pass_times.record(real, masks, spent, draft_masks=cfg.mode == "verified")  # verified's: drafts
    top = getattr(runner, "greedy", None) if cfg.temperature <= 0 else None  # the runner's argmax per row, if any
    # The mask token is never a prediction. The runner's argmax already leaves it out; the logits need it at -inf
    # only where something reads them: sampling, mask rows' confidences, the fallback of a constraint that could
    # allow it (a grammar never does: the mask is a special token). Writing it costs ~25 us on rows written by the
    # compute thread's core (measured, 8 clients), a step of every sequence between two batched passes, and gives
    # the GIL up to the other sequences' steps once more.
    if setup.mask_token_id < logits.shape[-1] and (
        top is None or masks or (constraint is not None and not _never_allows(constraint, setup.mask_token_id))
    ):
        logits[:, setup.mask_token_id] = float("-inf")
    stats.forward_passes += 1
    stats.k_used[masks + 1] = stats.k_used.get(masks + 1, 0) + 1
    if cfg.mode == "verified":
        result = _verify(logits, top, draft, masks, state, cfg, constraint, generator, stats)
        runner.drop(len(draft_tokens) - result.accepted_beyond_first + masks)
        state.pending = [result.new_tokens[-1]] if result.new_tokens else []
    else:
        result = _propose_and_accept(logits, top, masks, cfg, constraint, generator)
        runner.drop(masks)
        state.pending = list(result.new_tokens)
    setup.planner.observe(plan, result.proposed_beyond_first, result.accepted_beyond_first)
    return result


def _plain_if_hopeless(
    state: _State,
    cfg: DecodeConfig,
    planner: Planner,
    budget: int,
    constraint: TokenConstraint | None,
    *,
    lookup: bool = True,
) -> Plan | None:
    """The plain pass when no draft could pay this pass (:meth:`Planner.plain_if_hopeless`), without asking the
    sources; None to plan as usual. A constraint's forced text may be certain, so a grammar with a draft to offer
    always plans. ``lookup=False``: leave prompt-lookup drafts out (the caller found none worth verifying); where
    no MTP draft is pending either, masks are then the only options and the planner scores them as it would plan.
    A mask is worth at most FUTURE_CREDIT times its position's rate (its token is only the next pass's draft)."""
    if cfg.mode != "verified":  # (without sources too: the planner then finds nothing could pay but grammar text)
        return None
    if constraint is not None and "grammar" in cfg.drafts and _grammar_draft(constraint, budget - 1) is not None:
        return None
    rates = planner.rates
    p_max = max([rates.ngram, rates.ngram_short] if lookup and "ngram" in cfg.drafts else [0.0])
    if rates.positions:
        p_max = max(p_max, FUTURE_CREDIT * max(rates.positions))
    if state.mtp.pending is not None:  # its tokens blend the masks' confidences in (up to 1)
        p_max = max(p_max, 0.5 + 0.5 * max(rates.positions, default=0.5))
    masks_only = not lookup and state.mtp.pending is None  # nothing to verify: only masks could be added
    plan = planner.plain_if_hopeless(len(state.pending), p_max, budget - 1, masks_only=masks_only)
    if plan is not None:
        state.mtp.offer([], [])  # a pending mask block is valid for the next pass only: this one
    return plan


def _draft_sources(state: _State, cfg: DecodeConfig) -> list[DraftSource]:
    sources: list[DraftSource] = []
    if "mtp" in cfg.drafts:
        sources.append(state.mtp)
    if "ngram" in cfg.drafts:
        sources.append(NgramDraftSource(cfg.ngram_max, cfg.ngram_draft_len))
    return sources


def _drafts(state: _State, cfg: DecodeConfig, budget: int, constraint: TokenConstraint | None) -> list[Draft]:
    """Every source's proposal for the next pass (none outside verified mode), the grammar's forced text among
    them when a constraint has some (:func:`_grammar_draft`)."""
    proposals = [source.propose(state.context, budget - 1) for source in state.sources]
    if cfg.mode == "verified" and "grammar" in cfg.drafts and constraint is not None:
        proposals.append(_grammar_draft(constraint, budget - 1))
    return [d for d in proposals if d is not None and d.tokens]


def _grammar_draft(constraint: TokenConstraint, max_len: int) -> Draft | None:
    """The forced text's tokens that jump-forward leaves to the model (the last token of a forced string may
    merge with what follows, e.g. the `` "`` that opens a value after a key), as a draft to verify: accepted, it
    saves the pass that would produce it alone. Constraints without ``forced_draft`` propose nothing."""
    forced_draft = getattr(constraint, "forced_draft", None)
    tokens = forced_draft()[:max_len] if forced_draft is not None and max_len > 0 else []
    if not tokens:
        return None
    planned = len(constraint.forced_tokens())  # before jump-forward has taken them (the first pass): certain
    certain = tuple(1.0 if i < planned else 0.0 for i in range(len(tokens)))
    return Draft(tuple(tokens), "grammar", float(len(tokens)), certain)


def _masked_logits(row: torch.Tensor, constraint: TokenConstraint | None) -> torch.Tensor:
    if constraint is None:
        return row
    allowed = constraint.allowed_mask(row.shape[-1]).to(row.device)
    return row.masked_fill(~allowed, float("-inf"))


def _masked_probs(row: torch.Tensor, cfg: DecodeConfig, constraint: TokenConstraint | None) -> torch.Tensor:
    return probabilities(_masked_logits(row, constraint), cfg.temperature, cfg.top_p)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Row-wise argmax of ``logits`` [n, V]: the first of equal maxima, as ``torch.argmax``. On one CPU thread (the
    decode loop's) numpy's vectorised argmax takes ~4 us for the default model's 49k logits, torch's ~45 us: every
    sequence of a batched pass runs it in Python between passes, beside the pass."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return [int(i) for i in logits.detach().numpy().argmax(-1)]
    return [int(i) for i in logits.argmax(-1).tolist()]


def _never_allows(constraint: TokenConstraint, token_id: int) -> bool:
    """Whether ``constraint`` rules ``token_id`` out in every state (optional: ``GrammarConstraint.never_allows``)."""
    never = getattr(constraint, "never_allows", None)
    return bool(never(token_id)) if never is not None else False


def _greedy(logits: torch.Tensor, row: int, top: Sequence[int] | None, constraint: TokenConstraint | None) -> int:
    """The greedy token of ``logits[row]`` under ``constraint``. ``top``: the runner's argmax of every row (the fast
    runtime computes it where the logits were written: :meth:`FastModel.greedy_tokens`); when the constraint allows
    that token it is also the first maximum among the allowed ones, so the row is not read again here."""
    if top is None:
        return _argmax(_masked_logits(logits[row], constraint)[None])[0]
    token = top[row]
    if constraint is None:
        return token
    allows = getattr(constraint, "allows", None)  # optional: one bit instead of a whole mask (GrammarConstraint)
    if allows is not None and token < logits.shape[-1] and allows(token):
        return token
    allowed = constraint.allowed_mask(logits.shape[-1])
    if bool(allowed[token]):
        return token
    return _argmax(logits[row].masked_fill(~allowed.to(logits.device), float("-inf"))[None])[0]


def _choose(logits: torch.Tensor, cfg: DecodeConfig, generator: torch.Generator | None) -> list[int]:
    """One token per row of (masked) ``logits`` [n, V]: greedy takes the argmax of the logits themselves, as HF
    ``generate`` does (a softmax can round two different logits to one probability, and its argmax then takes the
    lower id); sampling draws from the tempered, nucleus-filtered distribution."""
    if cfg.temperature <= 0:
        return _argmax(logits)
    return [int(i) for i in pick(probabilities(logits, cfg.temperature, cfg.top_p), cfg.temperature, generator)]


def _propose_and_accept(
    logits: torch.Tensor,
    top: Sequence[int] | None,
    masks: int,
    cfg: DecodeConfig,
    constraint: TokenConstraint | None,
    generator: torch.Generator | None,
) -> _PassResult:
    """static / confadapt / ntp: token 1 from the last real position, tokens 2..k from the masks. ``top``: the
    runner's argmax per row (greedy decoding on the fast runtime), else None."""
    confident = masks > 0 and cfg.mode != "static"  # ConfAdapt reads token 1's probability
    first_logits = _masked_logits(logits[0], constraint) if top is None or confident else None  # [V]
    if top is not None:
        first = _greedy(logits, 0, top, constraint)
    else:
        assert first_logits is not None
        first = _choose(first_logits[None], cfg, generator)[0]
    if constraint is not None:
        constraint.accept(first)
    if masks == 0:
        return _PassResult([first], "ntp")
    rest = list(top[1:]) if top is not None else _choose(logits[1:], cfg, generator)  # [masks]
    valid = _grammar_prefix(rest, constraint)
    if not confident:
        accepted = 1 + valid
    else:
        assert first_logits is not None
        first_top = probabilities(first_logits, cfg.temperature, cfg.top_p).max()[None]
        rest_top = top_probabilities(logits[1:], cfg.temperature, cfg.top_p)  # [masks]
        accepted = min(confadapt_accept_length(torch.cat([first_top, rest_top]), cfg.threshold), 1 + valid)
    if constraint is not None and valid > accepted - 1:
        constraint.rollback(valid - (accepted - 1))
    return _PassResult([first, *rest[: accepted - 1]], "mtp", masks, accepted - 1)


def _grammar_prefix(tokens: list[int], constraint: TokenConstraint | None) -> int:
    """Offer tokens to the constraint in order; return how many it accepted (the state keeps them)."""
    if constraint is None:
        return len(tokens)
    for i, token in enumerate(tokens):
        if constraint.is_terminated() or not constraint.accept(token):
            return i
    return len(tokens)


def _verify(
    logits: torch.Tensor,
    top: Sequence[int] | None,
    draft: Draft | None,
    masks: int,
    state: _State,
    cfg: DecodeConfig,
    constraint: TokenConstraint | None,
    generator: torch.Generator | None,
    stats: DecodeStats,
) -> _PassResult:
    """Check the draft against the NTP logits at its positions; keep the matching prefix plus one model token.
    ``top``: the runner's argmax per row (greedy decoding on the fast runtime), else None."""
    tokens = list(draft.tokens) if draft else []
    accepted: list[int] = []
    correction: int | None = None
    for j, proposed in enumerate(tokens):
        if cfg.temperature > 0:
            ok, token = accept_or_resample(_masked_probs(logits[j], cfg, constraint), proposed, generator)
        else:
            token = _greedy(logits, j, top, constraint)  # from the logits, as HF generate
            ok = token == proposed
        if constraint is not None:
            constraint.accept(token)
        if not ok:
            correction = token
            break
        accepted.append(token)
        if constraint is not None and constraint.is_terminated():
            correction = -1
            break
    if correction is None:
        if top is not None:
            correction = _greedy(logits, len(tokens), top, constraint)
        else:
            correction = _choose(_masked_logits(logits[len(tokens)], constraint)[None], cfg, generator)[0]
        if constraint is not None:
            constraint.accept(correction)
        at = len(tokens) + 1
        mask_top = top[at : at + masks] if top is not None else None
        _offer_mtp_draft(state, logits[at : at + masks], mask_top, cfg, constraint)
    else:
        state.mtp.offer([], [])
    new_tokens = accepted + ([correction] if correction >= 0 else [])
    if draft is not None:
        _record_draft(stats, draft, len(accepted))
        for draft_source in state.sources:
            if draft_source.name == draft.source:
                draft_source.update(draft, len(accepted))
    source = draft.source if draft is not None and accepted else "ntp"
    return _PassResult(new_tokens, source, len(tokens), len(accepted))


def _offer_mtp_draft(
    state: _State,
    mask_logits: torch.Tensor,
    mask_top: Sequence[int] | None,
    cfg: DecodeConfig,
    constraint: TokenConstraint | None,
) -> None:
    if "mtp" not in cfg.drafts or mask_logits.shape[0] == 0:
        state.mtp.offer([], [])
        return
    # drafts are greedy (verification keeps exactness); the runner's argmax where it has one
    tokens = list(mask_top) if mask_top is not None else _argmax(mask_logits)  # [masks]
    valid = _grammar_prefix(tokens, constraint)
    if constraint is not None and valid:
        constraint.rollback(valid)
    confidences = top_probabilities(mask_logits[:valid], 0.0, 1.0).tolist() if valid else []
    state.mtp.offer(tokens[:valid], confidences)


def _record_draft(stats: DecodeStats, draft: Draft, accepted: int) -> None:
    entry = stats.draft_stats.setdefault(draft.source, {"passes": 0, "proposed": 0, "accepted": 0})
    entry["passes"] += 1
    entry["proposed"] += len(draft.tokens)
    entry["accepted"] += accepted


def _append(
    state: _State,
    tokens: list[int],
    cfg: DecodeConfig,
    setup: DecodeSetup,
    tracker: TextTracker,
    constraint: TokenConstraint | None,
) -> tuple[list[int], FinishReason | None, str]:
    """Add accepted tokens, honouring EOS, max_new_tokens and stop strings; return (kept, finish, text delta)."""
    finish: FinishReason | None = None
    kept: list[int] = []
    stop_ids = setup.eos_token_ids | set(cfg.stop_token_ids)
    for token in tokens:
        kept.append(token)
        if token in stop_ids:
            finish = "stop"
            break
        if len(state.out) + len(kept) >= cfg.max_new_tokens:
            finish = "length"
            break
    text_ids = [t for t in kept if t not in stop_ids]
    delta, n_text_kept = tracker.extend(text_ids)
    if tracker.stopped:
        kept = text_ids[:n_text_kept]
        finish = "stop"
    state.out += kept
    state.context += kept
    if finish is None and constraint is not None and constraint.is_terminated():
        finish = "stop"
    return kept, finish, delta


def _jump_forward(
    state: _State,
    cfg: DecodeConfig,
    setup: DecodeSetup,
    tracker: TextTracker,
    constraint: TokenConstraint,
) -> tuple[list[int], FinishReason | None, str]:
    """Append the tokens the grammar forces, without a forward pass."""
    forced = constraint.forced_tokens()[: max(cfg.max_new_tokens - len(state.out), 0)]
    taken: list[int] = []
    for token in forced:
        if not constraint.accept(token):
            break
        taken.append(token)
    if not taken:
        return [], None, ""
    kept, finish, delta = _append(state, taken, cfg, setup, tracker, constraint)
    state.pending += kept
    state.mtp.advance(kept)  # the masks' block stays a draft past the forced tokens it predicted
    return kept, finish, delta
