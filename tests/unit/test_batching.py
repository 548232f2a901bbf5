"""Continuous batching (engine/batching.py): concurrent generations share passes and get what they get alone."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent_mtp.engine import DecodeConfig, MTPEngine
from agent_mtp.engine.batching import BatchedEngine, PassTime, pass_time_curve, shared_pass_cost
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.fast import FastRunner
from tests.tiny import tiny_engine

CURVE = CostCurve(((1, 1.0), (4, 1.3), (8, 1.6), (16, 2.2), (32, 3.4)))


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def engine() -> MTPEngine:
    engine = tiny_engine(adapter=True)
    engine.set_cost_curve(CURVE)
    return engine


CONFIGS = [
    DecodeConfig(mode="ntp", max_new_tokens=24, prefix_cache=False),
    DecodeConfig(mode="verified", k_max=4, max_new_tokens=30, prefix_cache=False),
    DecodeConfig(mode="confadapt", threshold=0.0, k_max=4, max_new_tokens=18, prefix_cache=False),
    DecodeConfig(mode="verified", k_max="auto", max_new_tokens=20),
]


def test_interleaved_generations_equal_alone(engine: MTPEngine) -> None:
    """Requests of different modes and lengths join and leave while others decode: each equals its run alone."""
    jobs = [(_ids(5 + 3 * i, i), CONFIGS[i % len(CONFIGS)]) for i in range(8)]
    expected = [engine.generate(p, c).token_ids for p, c in jobs]
    batched = BatchedEngine(engine)
    try:

        def run(i: int) -> list[int]:
            time.sleep(0.003 * i)  # staggered starts: sequences join passes already under way
            prompt, cfg = jobs[i]
            return batched.generate(prompt, cfg).token_ids

        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(run, range(len(jobs))))
        assert got == expected
        assert batched.scheduler is not None
        stats = batched.scheduler.stats()
        assert stats.mean_batch > 1.0  # passes really were shared
        assert stats.active == 0  # every sequence left
    finally:
        batched.close()


def test_a_stream_left_early_leaves_the_batch_at_once(engine: MTPEngine) -> None:
    batched = BatchedEngine(engine)
    try:
        stream = batched.stream(_ids(6, 1), CONFIGS[0])
        next(stream)
        assert batched.scheduler is not None and batched.scheduler.stats().active == 1
        stream.close()
        assert batched.scheduler.stats().active == 0
        other = threading.Thread(target=lambda: batched.generate(_ids(6, 2), CONFIGS[0]))
        other.start()
        other.join(timeout=30)
        assert not other.is_alive()
    finally:
        batched.close()


def test_shared_pass_cost_grows_with_concurrency() -> None:
    times = pass_time_curve(CURVE, [None] * 65)
    assert shared_pass_cost(times, 4, others=0, other_rows=0) == pytest.approx(CURVE.cost(4))
    alone, busy = (shared_pass_cost(times, 4, others=o, other_rows=o) for o in (1, 15))
    assert shared_pass_cost(times, 1, others=15, other_rows=15) == pytest.approx(1.0)
    assert busy > alone > 1.0
    assert shared_pass_cost(times, 8, others=20, other_rows=60) > busy  # beyond the table: extrapolated


def test_a_shared_curve_reads_the_load_once_for_every_size(engine: MTPEngine) -> None:
    """The planner asks for a pass's whole range of sizes at once: the same costs as one size at a time, alone and
    beside others, and a plain curve's range is its points' interpolation."""
    assert list(CURVE.costs(3, 4)) == [CURVE.cost(n) for n in (3, 4, 5, 6)]
    batched = BatchedEngine(engine)
    try:
        runner = batched.scheduler.runner() if batched.scheduler is not None else None
        assert runner is not None
        curve = runner.share_curve(CURVE)
        for load in ((0, 0), (3, 5), (15, 40)):
            runner.shared_load = load
            assert list(curve.costs(2, 12)) == [curve.cost(n) for n in range(2, 14)]
        assert list(curve.costs(1, 3)) != list(CURVE.costs(1, 3))  # beside 15 others, rows cost more than alone
        shared = runner.share_curve(CostCurve(CURVE.points, 0.4))
        runner.shared_load = (0, 0)
        assert shared.mask_share == 0.4  # alone: the base curve's draft-only masks
        runner.shared_load = (3, 5)
        assert shared.mask_share == 1.0  # beside others: the fitted pass times already hold the masks' discount
        runner.close()
    finally:
        batched.close()


def test_measured_pass_times_replace_the_base_curve() -> None:
    table: list[PassTime | None] = [None] * 65
    table[1] = PassTime(0.05, 5)
    assert pass_time_curve(CURVE, table)[8] == pytest.approx(CURVE.cost(8))  # one row count: not enough
    table[8] = PassTime(0.20, 5)  # rows cost far more than the base curve says (1.6x at 8)
    table[9] = PassTime(0.15, 5)  # noise: never makes rows look free
    times = pass_time_curve(CURVE, table)
    assert all(b > a for a, b in itertools.pairwise(times))
    assert times[8] / times[1] > CURVE.cost(8)
    measured = shared_pass_cost(times, 4, others=3, other_rows=3)
    assumed = shared_pass_cost(pass_time_curve(CURVE, [None] * 65), 4, others=3, other_rows=3)
    assert measured > assumed  # drafts shrink once passes are measured to be dear
    flat: list[PassTime | None] = [None] * 257
    flat[8], flat[40] = PassTime(0.2, 5), PassTime(0.2, 5)  # noise on a starved CPU: rows look free
    times = pass_time_curve(CURVE, flat)
    slope = (CURVE.cost(16) - CURVE.cost(1)) / 15
    assert (times[100] - times[99]) / (times[1] - (times[2] - times[1])) >= slope * 0.999


def test_hf_runtime_engine_is_served_serially() -> None:
    engine = tiny_engine(adapter=True)
    hf = engine.with_runtime("hf")
    batched = BatchedEngine(hf)
    assert batched.scheduler is None
    cfg = CONFIGS[1]
    hf.set_cost_curve(CURVE)
    assert batched.generate(_ids(7, 3), cfg).token_ids == hf.generate(_ids(7, 3), cfg).token_ids


def test_service_in_batched_mode_equals_serial(engine: MTPEngine) -> None:
    from agent_mtp.service import Limits, Request, Service

    requests = [
        Request(
            messages=({"role": "user", "content": f"question {i}"},),
            policy=None,
            decode=CONFIGS[i % 2],
            limits=Limits(max_tokens=12 + i),
        )
        for i in range(4)
    ]
    expected = [Service(engine).generate(r).generation.token_ids for r in requests]
    service = Service(engine, concurrency="batched")
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda r: service.generate(r).generation.token_ids, requests))
    finally:
        service.close()
    assert got == expected


def test_pass_times_with_a_knee_are_fitted_in_two_segments() -> None:
    """Memory-bound passes (1-8 rows cost about the same) then compute-bound ones (each row adds 2.5 ms): the
    marginal cost past the knee is what the fit must give, not a line's average through every row count."""
    table: list[PassTime | None] = [None] * 65
    for rows in range(1, 25):
        table[rows] = PassTime(0.040 + 0.0005 * rows + 0.0025 * max(rows - 8, 0), 10)
    flat = CostCurve(((1, 1.0), (16, 1.1)))  # alone, rows are nearly free: the floor does not bind
    times = pass_time_curve(flat, table)
    assert (times[20] - times[12]) / 8 == pytest.approx(0.003, rel=0.02)  # seconds per row past the knee
    assert (times[6] - times[2]) / 4 == pytest.approx(0.0005, rel=0.05)
    straight: list[PassTime | None] = [None] * 65
    for rows in range(1, 25):
        straight[rows] = PassTime(0.040 + 0.001 * rows, 10)
    line = pass_time_curve(flat, straight)
    assert (line[20] - line[12]) / 8 == pytest.approx(0.001, rel=0.02)
    assert (line[6] - line[2]) / 4 == pytest.approx(0.001, rel=0.02)


def test_the_scheduler_refits_pass_times_once_per_refit_period(engine: MTPEngine) -> None:
    from agent_mtp.engine import batching

    batched = BatchedEngine(engine)
    try:
        scheduler = batched.scheduler
        assert scheduler is not None
        first = scheduler.pass_time_curve(CURVE)
        assert scheduler.pass_time_curve(CURVE) is first  # every sequence reads one fit
        batched.generate(_ids(9, 1), DecodeConfig(mode="ntp", max_new_tokens=batching.REFIT_EVERY + 2))
        assert scheduler.stats().passes >= batching.REFIT_EVERY
        assert scheduler.pass_time_curve(CURVE) is not first
    finally:
        batched.close()


def test_a_pass_waits_for_a_sequence_still_in_its_decode_step(engine: MTPEngine) -> None:
    """A sequence that submits within half of the last pass's time joins the pass instead of running alone after it
    (on 2 cores the last of 8 sequences' Python decode steps ends several ms after the first)."""
    from agent_mtp.engine.batching import BatchScheduler

    batched = BatchedEngine(engine, window_s=0.001)
    scheduler = batched.scheduler
    assert isinstance(scheduler, BatchScheduler)
    try:
        first, second = scheduler.runner(), scheduler.runner()
        prefill = threading.Thread(target=second.forward, args=(_ids(5, 3), 1))
        prefill.start()
        first.forward(_ids(6, 1), 1)  # both in the batch now (a sequence joins with its first pass)
        prefill.join(timeout=30)
        before = scheduler.stats()
        scheduler._last_pass_s = 0.4  # as if passes took 400 ms: the wait is bounded at 200 ms
        late = 0.1  # a quarter of a pass (past 0.15 of one, the share that fragmented 8-client batches)
        done = threading.Event()

        def submit_late() -> None:
            time.sleep(late)
            second.forward(_ids(3, 2), 1)
            done.set()

        thread = threading.Thread(target=submit_late)
        thread.start()
        first.forward(_ids(4, 1), 1)
        thread.join(timeout=30)
        assert done.is_set()
        stats = scheduler.stats()
        assert (stats.passes - before.passes, stats.sequences - before.sequences) == (1, 2)  # one pass carried both
        first.close()
        second.close()
    finally:
        batched.close()


def test_a_sequence_joins_the_batch_with_its_first_pass(engine: MTPEngine) -> None:
    """A generation still preparing its prompt (chat template, tokenizer, prefix cache: milliseconds under the GIL)
    is not waited for: passes wait only for sequences that have fed a pass and will feed the next."""
    batched = BatchedEngine(engine)
    scheduler = batched.scheduler
    assert scheduler is not None
    try:
        preparing, decoding = scheduler.runner(), scheduler.runner()
        assert scheduler.stats().active == 0
        decoding.forward(_ids(5, 1), 1)
        assert scheduler.stats().active == 1  # the runner that fed no pass is not in the batch
        assert scheduler.load(preparing) == (1, 1)  # but it plans against the one that is
        preparing.forward(_ids(4, 2), 1)
        assert scheduler.stats().active == 2
        preparing.close()
        decoding.close()
        assert scheduler.stats().active == 0
    finally:
        batched.close()


def test_a_generation_leaves_the_batch_with_its_last_chunk(engine: MTPEngine) -> None:
    """No pass follows a generation's last chunk, so the next pass must not wait for it while its caller handles
    that chunk (the server's response, telemetry) before closing the stream."""
    batched = BatchedEngine(engine)
    scheduler = batched.scheduler
    assert scheduler is not None
    try:
        seen_active = []
        for chunk in batched.stream(_ids(6, 3), DecodeConfig(mode="ntp", max_new_tokens=4)):
            seen_active.append(scheduler.stats().active)
            if chunk.finish_reason is not None:
                assert scheduler.stats().active == 0  # left before the caller has even asked for the end
        assert seen_active[0] == 1 and seen_active[-1] == 0
    finally:
        batched.close()


def test_a_neighbours_prefill_does_not_count_as_its_next_load(engine: MTPEngine) -> None:
    """The load a sequence plans against is what the others will feed next: a neighbour that just prefilled 40
    tokens feeds one row or a few next, not 40 (which made every extra row look nearly free); after a decode pass,
    its rows as fed."""
    batched = BatchedEngine(engine)
    scheduler = batched.scheduler
    assert scheduler is not None
    try:
        planner_side, neighbour = scheduler.runner(), scheduler.runner()
        thread = threading.Thread(target=neighbour.forward, args=(_ids(40, 3), 1))
        thread.start()
        planner_side.forward(_ids(5, 4), 1)
        thread.join(timeout=30)
        assert scheduler.load(planner_side) == (1, 1)
        thread = threading.Thread(target=neighbour.forward, args=(_ids(3, 5), 3))
        thread.start()
        planner_side.forward([7], 1)
        thread.join(timeout=30)
        assert scheduler.load(planner_side) == (1, 3)  # a decode pass of 3 rows (a draft): its rows
        planner_side.close()
        neighbour.close()
    finally:
        batched.close()


class _OnePassRunner(FastRunner):
    """A fast runner without greedy runs: the decode loop makes every pass itself (the reference for runs)."""

    greedy_steps = None  # type: ignore[assignment]  # opts out of runner.GreedyRunRunner


def _one_pass_runner(engine: MTPEngine) -> _OnePassRunner:
    runner = engine.new_runner()
    assert isinstance(runner, FastRunner)
    return _OnePassRunner(runner.model)


def test_a_single_sequence_takes_greedy_runs_on_the_compute_thread(engine: MTPEngine) -> None:
    """The fast runner alone chains its plain greedy passes in one call to the compute thread: the same tokens and
    cache as passes made one at a time, and the same generations."""
    from agent_mtp.engine.runner import GreedyRunRunner

    prompt = _ids(7, 12)
    one, runs = _one_pass_runner(engine), engine.new_runner()
    assert isinstance(runs, FastRunner) and isinstance(runs, GreedyRunRunner)
    assert not isinstance(one, GreedyRunRunner)
    for r in (one, runs):
        r.forward(prompt, 1)
    expected = []
    for _ in range(9):
        assert one.greedy is not None
        expected.append(one.greedy[-1])
        one.forward([expected[-1]], 1)
    tokens, ended = runs.greedy_steps(expected[0], 5, frozenset())
    assert tokens == expected[1:6] and ended == sorted(ended) and len(ended) == 5
    assert runs.tokens == [*prompt, *expected[:5]] and runs.length == len(prompt) + 5
    assert runs.greedy == [expected[5]]
    seen: list[int] = []

    def second(token: int) -> bool:
        seen.append(token)
        return len(seen) == 2

    tokens, _ = runs.greedy_steps(expected[5], 4, frozenset(), second)
    assert tokens == seen == expected[6:8]  # ``until`` said stop after the second: it was not fed
    assert runs.length == len(prompt) + 7
    with pytest.raises(ValueError, match="steps=0"):
        runs.greedy_steps(1, 0, frozenset())
    cfg = DecodeConfig(mode="ntp", max_new_tokens=11, prefix_cache=False)
    alone = list(engine.stream(prompt, cfg, runner=_one_pass_runner(engine)))
    chained = list(engine.stream(prompt, cfg, runner=engine.new_runner()))
    assert [c.token_ids for c in chained] == [c.token_ids for c in alone]


def test_plain_greedy_steps_run_in_the_scheduler_without_waking_the_caller(engine: MTPEngine) -> None:
    """``ntp`` on a batched runner takes its passes in greedy runs: the scheduler feeds each pass's argmax to the
    next itself, so the caller wakes once a run, and the tokens, the cache and the stop are the loop's own."""
    batched = BatchedEngine(engine)
    scheduler = batched.scheduler
    assert scheduler is not None
    try:
        alone = _one_pass_runner(engine)
        runner = scheduler.runner()
        prompt = _ids(7, 11)
        for r in (alone, runner):
            r.forward(prompt, 1)
        expected = []
        for _ in range(9):  # the loop's own passes: feed the argmax, one pass at a time
            assert alone.greedy is not None
            expected.append(alone.greedy[-1])
            alone.forward([expected[-1]], 1)
        assert runner.greedy is not None
        first = runner.greedy[-1]
        assert first == expected[0]
        before = scheduler.stats().passes
        tokens, ended = runner.greedy_steps(first, 5, frozenset())
        assert tokens == expected[1:6]
        assert scheduler.stats().passes - before == 5 and ended == sorted(ended) and len(ended) == 5
        assert runner.tokens == [*prompt, *expected[:5]] and runner.length == len(prompt) + 5  # the last not fed
        stop = expected[7]
        tokens, _ = runner.greedy_steps(expected[5], 4, frozenset({stop}))  # a stop token ends the run after it
        assert tokens == expected[6 : expected.index(stop, 6) + 1]
        assert runner.length == len(prompt) + 5 + len(tokens)
        at = runner.length - len(prompt)  # the next pending token is expected[at]
        tokens, _ = runner.greedy_steps(expected[at], 4, frozenset(), lambda t: t == expected[at + 1])
        assert tokens == [expected[at + 1]]  # ``until`` ends the run after its first token, on the scheduler thread
        runner.close()
        with pytest.raises(RuntimeError, match="left the batch"):
            runner.greedy_steps(1, 2, frozenset())
    finally:
        batched.close()


@pytest.mark.parametrize("max_new_tokens", [2, 3, 5, 8, 9])
def test_greedy_runs_stop_where_the_loop_stops(engine: MTPEngine, max_new_tokens: int) -> None:
    """Length, a stop token and a stop string falling anywhere inside a run: the batched output, its chunks' token
    counts and what the runner holds afterwards (what the prefix cache keeps) are those of the loop's own passes."""
    prompt = _ids(6, 21)
    plain = DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens, prefix_cache=False)
    reference = engine.generate(prompt, DecodeConfig(mode="ntp", max_new_tokens=12, prefix_cache=False))
    stop_token = reference.token_ids[max_new_tokens // 2]
    stop_text = engine.tokenizer.decode(reference.token_ids[: max_new_tokens // 2 + 1])[-2:]
    configs = [
        plain,
        plain.replace(max_new_tokens=12, stop_token_ids=(stop_token,)),
        plain.replace(max_new_tokens=12, stop=(stop_text,)) if stop_text.strip() else plain,
    ]
    batched = BatchedEngine(engine)
    assert batched.scheduler is not None
    try:
        for cfg in configs:
            alone = _one_pass_runner(engine)
            chunks = list(engine.stream(prompt, cfg, runner=alone))
            runner = batched.scheduler.runner()
            batched_chunks = list(engine.stream(prompt, cfg, runner=runner))
            assert [c.token_ids for c in batched_chunks] == [c.token_ids for c in chunks], cfg
            assert "".join(c.text for c in batched_chunks) == "".join(c.text for c in chunks)
            assert batched_chunks[-1].finish_reason == chunks[-1].finish_reason
            assert batched_chunks[-1].stats is not None and chunks[-1].stats is not None
            assert batched_chunks[-1].stats.forward_passes == chunks[-1].stats.forward_passes
            assert runner.tokens == alone.tokens and runner.length == alone.length
            runner.close()
    finally:
        batched.close()


def test_a_deadline_inside_a_greedy_run_ends_at_the_pass_that_crossed_it(
    engine: MTPEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop's deadline checks a greedy run's tokens against the time each one's pass ended: the token whose pass
    ended past ``max_time`` is the last one (as after a pass of the loop's own), the rest are dropped."""
    from agent_mtp.engine.batching import BatchingRunner

    real = BatchingRunner.greedy_steps

    def slow_third(
        self: BatchingRunner,
        first: int,
        steps: int,
        stop_ids: frozenset[int],
        until: Callable[[int], bool] | None = None,
    ) -> tuple[list[int], list[float]]:
        tokens, ended = real(self, first, steps, stop_ids, until)
        return tokens, [t + (60.0 if i >= 2 else 0.0) for i, t in enumerate(ended)]  # the third pass "ended late"

    monkeypatch.setattr(BatchingRunner, "greedy_steps", slow_third)
    batched = BatchedEngine(engine)
    assert batched.scheduler is not None
    try:
        runner = batched.scheduler.runner()
        cfg = DecodeConfig(mode="ntp", max_new_tokens=20, max_time=30.0, prefix_cache=False)
        chunks = list(engine.stream(_ids(5, 8), cfg, runner=runner))
        assert chunks[-1].finish_reason == "timeout"
        produced = [t for c in chunks for t in c.token_ids]
        assert len(produced) == 1 + 3  # the prefill's token, then a run's first three (the third crossed)
        assert runner.length == 5 + 3  # the prompt and the three tokens before the next pending one
        runner.close()
    finally:
        batched.close()


def test_verified_takes_greedy_runs_where_no_draft_could_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside other sequences most verified passes are hopeless (no draft could pay): those run as greedy runs, as
    ``ntp`` does, up to the planner's next exploring pass; the output is still what the sequence gives alone."""
    from agent_mtp.engine.batching import BatchingRunner

    engine = tiny_engine(adapter=True)
    engine.set_cost_curve(CostCurve(tuple((n, float(n)) for n in (1, 2, 4, 8, 16, 32))))  # a row costs a pass
    runs: list[int] = []
    real = BatchingRunner.greedy_steps

    def counted(
        self: BatchingRunner,
        first: int,
        steps: int,
        stop_ids: frozenset[int],
        until: Callable[[int], bool] | None = None,
    ) -> tuple[list[int], list[float]]:
        runs.append(steps)
        return real(self, first, steps, stop_ids, until)

    monkeypatch.setattr(BatchingRunner, "greedy_steps", counted)
    cfg = DecodeConfig(mode="verified", k_max=4, max_new_tokens=30, prefix_cache=False)
    prompts = [_ids(6 + i, 30 + i) for i in range(3)]
    expected = [engine.generate(p, cfg).token_ids for p in prompts]
    batched = BatchedEngine(engine)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: batched.generate(p, cfg).token_ids, prompts))
        assert got == expected
        assert runs and max(runs) == 4 and sum(runs) >= 3 * 20  # most of each sequence's passes in runs
    finally:
        batched.close()


def test_verified_runs_end_where_the_prompt_lookup_finds_a_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Alone, where a row costs less than a prompt-lookup draft token expects but more than a mask is worth (its
    token is only the next pass's draft), ``verified`` takes greedy runs that end at the first token after which the
    lookup has a match worth verifying: the same passes, drafts and tokens as the loop making every pass itself."""
    engine = tiny_engine(adapter=True)
    engine.set_cost_curve(CostCurve(((1, 1.0), (2, 1.3), (4, 1.9), (8, 3.1), (16, 5.5), (32, 10.3))))
    watched: list[bool] = []
    real = FastRunner.greedy_steps

    def counted(
        self: FastRunner, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None = None
    ) -> tuple[list[int], list[float]]:
        watched.append(until is not None)
        return real(self, first, steps, stop_ids, until)

    monkeypatch.setattr(FastRunner, "greedy_steps", counted)
    cfg = DecodeConfig(mode="verified", k_max=4, max_new_tokens=60, prefix_cache=False)
    drafted = 0
    for seed in range(4):
        prompt = _ids(12, seed) * 2  # a repeated prompt: the lookup matches in it and in the output
        own = list(engine.stream(prompt, cfg, runner=_one_pass_runner(engine)))
        runs = list(engine.stream(prompt, cfg, runner=engine.new_runner()))
        assert [c.token_ids for c in runs] == [c.token_ids for c in own]
        mine, theirs = runs[-1].stats, own[-1].stats
        assert mine is not None and theirs is not None
        assert (mine.forward_passes, mine.draft_stats) == (theirs.forward_passes, theirs.draft_stats)
        drafted += theirs.draft_stats.get("ngram", {}).get("passes", 0)
    assert drafted and watched and all(watched)  # drafts were verified between watched runs


def test_a_step_in_the_measured_pass_times_is_kept_and_shared() -> None:
    """AMX tiles multiply rows in chunks of 8: 8 one-row sequences cost a pass 15 ms, a 9th row 21 ms, rows 9-16
    about the same. The curve keeps the step where it was measured (a fitted line spread it as ~1.6 ms a row), and
    a sequence's extra rows share with the others' what all extra rows add: one draft row beside 7 plain sequences
    pays the whole step, one beside 7 that draft too pays an eighth of it."""
    table: list[PassTime | None] = [None] * 65
    for rows in range(1, 25):
        chunks = (rows + 7) // 8
        table[rows] = PassTime(0.009 + 0.006 * (chunks - 1) + 0.0008 * rows, 10)
    table[7] = PassTime(0.0170, 10)  # a dip (passes of fewer sequences): pooled, never a cheaper row
    flat = CostCurve(((1, 1.0), (16, 1.2)))
    times = pass_time_curve(flat, table)
    assert all(b >= a for a, b in itertools.pairwise(times[1:]))
    assert times[9] - times[8] > 5 * (times[12] - times[11])  # the step stays a step
    alone = shared_pass_cost(times, 2, others=7, other_rows=7)
    shared = shared_pass_cost(times, 2, others=7, other_rows=14)  # the 7 others each feed a draft row too
    assert alone == pytest.approx(1 + 8 * (times[9] - times[8]) / times[8])
    assert shared == pytest.approx(1 + 8 / 8 * (times[16] - times[8]) / times[15])
    assert alone > 1.8 > shared  # a draft token of p = 0.8 (1.8 tokens) does not pay the step alone, and pays shared
    line = pass_time_curve(flat, [PassTime(0.01 + 0.001 * r, 10) if r else None for r in range(65)])
    for other_rows in (7, 10, 14):  # on a line the average is the margin: every sequence pays its own rows
        assert shared_pass_cost(line, 3, others=7, other_rows=other_rows) == pytest.approx(
            1 + 8 * (line[other_rows + 3] - line[other_rows + 1]) / line[other_rows + 1]
        )


def _hinge_by_solving_every_knee(points: list[tuple[int, float, int]]) -> tuple[float, float, float, int] | None:
    """The reference: each knee's weighted least squares solved over every point (numpy), the lowest error kept."""
    import numpy as np

    rows = sorted({r for r, _, _ in points})
    best: tuple[float, tuple[float, float, float, int]] | None = None
    r = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points])
    w = np.array([p[2] for p in points], dtype=float)
    for knee in rows[1:-2]:
        x = np.stack([np.ones_like(r), r, np.maximum(r - knee, 0)], axis=1)
        a, b, c = np.linalg.solve(x.T @ (w[:, None] * x), x.T @ (w * t))
        if a <= 0 or b < 0 or c <= 0:
            continue
        sse = float(np.sum(w * (x @ np.array([a, b, c]) - t) ** 2))
        if best is None or sse < best[0]:
            best = (sse, (float(a), float(b), float(c), knee))
    return best[1] if best is not None else None


def test_the_two_segment_fit_is_linear_in_the_points_and_finds_each_knees_least_squares() -> None:
    """A server's table holds ~100 measured row counts; the fit assembles each knee's normal equations from running
    sums (it solved each knee over every point before: ~40 ms of Python holding the GIL per refit at 120 row
    counts). Same knee and coefficients as solving every knee outright, on curves with a knee, lines and noise."""
    from agent_mtp.engine.batching import _hinge

    rng = random.Random(7)
    found = 0
    for trial in range(60):
        rows = sorted(rng.sample(range(1, 257), rng.randint(4, 120)))
        knee, a, b, c = rng.choice(rows[1:-2]), rng.uniform(0.005, 0.02), rng.uniform(0, 0.002), rng.uniform(0, 0.004)
        noise = rng.choice([0.0, 1e-4, 1e-3])
        points = [(r, a + b * r + c * max(r - knee, 0) + rng.uniform(0, noise), rng.randint(2, 20)) for r in rows]
        got, expected = _hinge(points), _hinge_by_solving_every_knee(points)
        assert (got is None) == (expected is None), trial
        if got is not None and expected is not None:
            found += 1
            assert got[3] == expected[3], trial
            assert got[:3] == pytest.approx(expected[:3], rel=1e-6, abs=1e-9), trial
    assert found > 30


@pytest.mark.parametrize("mode", ["confadapt", "static"])
def test_auto_k_takes_greedy_runs_where_its_k_is_one(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """static / ConfAdapt with k_max="auto", where masks cost more than they are expected to return (a row costs a
    pass), make their passes without masks as greedy runs of the runner's own, up to the planner's next exploring
    pass: the same tokens and the same passes with masks as the loop making every pass itself."""
    engine = tiny_engine(adapter=True)
    # a row adds 0.45 of a pass: a mask does not pay at the prior rates, but an exploring pass can afford one
    engine.set_cost_curve(CostCurve(tuple((n, 1.0 + 0.45 * (n - 1)) for n in (1, 2, 4, 8, 16, 32))))
    runs: list[int] = []
    real = FastRunner.greedy_steps

    def counted(
        self: FastRunner, first: int, steps: int, stop_ids: frozenset[int], until: Callable[[int], bool] | None = None
    ) -> tuple[list[int], list[float]]:
        runs.append(steps)
        return real(self, first, steps, stop_ids, until)

    monkeypatch.setattr(FastRunner, "greedy_steps", counted)
    cfg = DecodeConfig(mode=mode, k_max="auto", threshold=0.5, max_new_tokens=40, prefix_cache=False)  # type: ignore[arg-type]
    for seed in range(3):
        prompt = _ids(10, 40 + seed)
        own = list(engine.stream(prompt, cfg, runner=_one_pass_runner(engine)))
        runs.clear()
        chained = list(engine.stream(prompt, cfg, runner=engine.new_runner()))
        assert [c.token_ids for c in chained] == [c.token_ids for c in own]
        mine, theirs = chained[-1].stats, own[-1].stats
        assert mine is not None and theirs is not None
        assert (mine.forward_passes, mine.k_used) == (theirs.forward_passes, theirs.k_used)
        assert any(k > 1 for k in theirs.k_used)  # exploring passes took masks, as without runs
        assert runs and sum(runs) >= mine.forward_passes // 2  # most plain passes made in runs


def test_a_failing_run_watch_fails_its_own_run_and_the_scheduler_goes_on(engine: MTPEngine) -> None:
    """A greedy run's ``until`` (the prompt lookup's watch) runs on the scheduler thread: its error is raised to its
    own caller, and the scheduler keeps serving the other sequences (before, the error ended the scheduler thread and
    every caller waited forever)."""
    batched = BatchedEngine(engine)
    assert batched.scheduler is not None
    try:
        runner = batched.scheduler.runner()
        runner.forward(_ids(6, 3), 1)
        seen: list[int] = []

        def broken(token: int) -> bool:
            seen.append(token)
            if len(seen) == 2:
                raise RuntimeError("the watch broke")
            return False

        raised: list[BaseException] = []

        def run() -> None:
            try:
                runner.greedy_steps(5, 4, frozenset(), broken)
            except BaseException as e:
                raised.append(e)

        caller = threading.Thread(target=run, daemon=True)  # a daemon: a hung caller cannot hang the test session
        caller.start()
        caller.join(timeout=30)
        assert not caller.is_alive(), "the caller still waits for its run"
        assert len(raised) == 1 and "the watch broke" in str(raised[0])
        assert len(seen) == 2
        runner.close()
        cfg = DecodeConfig(mode="ntp", max_new_tokens=8, prefix_cache=False)
        prompt = _ids(5, 4)
        assert batched.generate(prompt, cfg).token_ids == engine.generate(prompt, cfg).token_ids
    finally:
        batched.close()
