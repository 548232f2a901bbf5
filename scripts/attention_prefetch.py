"""Attention's prefetch forms side by side: the next chunk asked for as the loops go, or all at its start.

    .venv/bin/python scripts/attention_prefetch.py --sequences 8 --context 400             # attention alone
    .venv/bin/python scripts/attention_prefetch.py --sequences 8 --context 400 --passes    # whole batched passes

The forms give the same numbers (checked here on every call). The attention alone: one ``attend`` call per layer of
the default model's shape (9 query heads, 3 key / value heads of 64) over 30 layers' distinct caches (cold, as in a
pass), ``--sequences`` caches of ``--context`` positions, ``--rows`` new rows each. With ``--passes``: whole
``FastModel.forward_batch`` passes of the default model, one row per sequence. The forms alternate in random order
call by call in one process, so that the machine's drift (+-30% from one minute to the next on the 2-core VMs)
falls on both; prints the median and best time of each and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from agent_mtp.engine.fast import blockq
from agent_mtp.engine.threads import single_threaded

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def attention_call(sequences: int, context: int, rows: int) -> Callable[[], torch.Tensor]:
    """One pass's attention over 30 layers of fresh caches (the new rows' keys and values written at ``context``)."""
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.randn(sequences * rows, width)
    angles = torch.rand(sequences * rows, 1, HEAD_DIM // 2)
    rope = torch.polar(torch.ones_like(angles), angles)
    layers = [[torch.randn(2, KV_HEADS, context + rows, HEAD_DIM) for _ in range(sequences)] for _ in range(LAYERS)]
    starts, counts = [context] * sequences, [rows] * sequences

    def call() -> torch.Tensor:
        outs = [
            torch.ops.agent_mtp_blockq.attend(
                qkv.clone(), rope, caches, starts, counts, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5
            )
            for caches in layers
        ]
        return outs[-1]

    return call


def pass_call(sequences: int, context: int) -> Callable[[], torch.Tensor]:
    """One batched pass of the default model: one new row for each of ``sequences`` caches of ``context`` tokens."""
    from agent_mtp.engine import MTPEngine
    from agent_mtp.engine.fast import FastRunner
    from agent_mtp.engine.fast.model import BatchItem
    from agent_mtp.engine.threads import compute

    engine = MTPEngine.from_pretrained("default")
    engine.prepare_runtime()
    runner = engine.new_runner()
    if not isinstance(runner, FastRunner):
        raise SystemExit("The fast runtime is not available here.")
    fast = runner.model
    generator = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(sequences):
        cache = fast.new_cache()
        prompt = torch.randint(100, 40_000, (context,), generator=generator).tolist()
        compute().run(fast.forward_batch, [BatchItem(prompt, cache, 1)])
        caches.append(cache)

    def one_pass() -> torch.Tensor:
        out = torch.cat(fast.forward_batch([BatchItem([1000], cache, 1) for cache in caches]))
        for cache in caches:
            cache.truncate(context)
        return out

    # on the engine's compute thread, as the engine runs its passes: the engine's load started an OpenMP pool there,
    # and a second one here would make every parallel region wait for a futex wake-up (engine/threads.py)
    return lambda: compute().run(one_pass)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--context", type=int, default=400, help="cached positions per sequence")
    parser.add_argument("--rows", type=int, default=1, help="new rows per sequence (attention alone)")
    parser.add_argument("--calls", type=int, default=30, help="calls of each form")
    parser.add_argument("--passes", action="store_true", help="whole passes of the default model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not blockq.kernels_available():
        raise SystemExit("The block-weight kernels are not available on this machine.")
    call = (
        pass_call(args.sequences, args.context)
        if args.passes
        else attention_call(args.sequences, args.context, args.rows)
    )
    # the kernels' switch (attention_prefetch in kernels/blockq.cpp): 1 spread in every loop (the default), 0 a
    # burst per chunk, 2 spread in the AVX2 loops and a burst in the AVX-512 pair loops (before 2026-12-07, evening)
    forms = {"spread (default)": 1, "burst per chunk": 0, "burst in pairs": 2}
    switch = torch.ops.agent_mtp_blockq.attention_prefetch
    before = int(switch(-1))
    times: dict[str, list[float]] = {name: [] for name in forms}
    outputs: dict[str, torch.Tensor] = {}
    try:
        for _ in range(args.calls):
            for name in random.sample(list(forms), len(forms)):
                switch(forms[name])
                started = time.perf_counter()
                out = call()
                times[name].append(time.perf_counter() - started)
                with single_threaded():  # no OpenMP pool of this thread's beside the compute thread's (--passes)
                    same = torch.equal(outputs.setdefault(name, out), out)
                if not same:
                    raise SystemExit(f"{name}: a call gave other numbers than the same call before")
    finally:
        switch(before)
    first, second, _ = forms
    with single_threaded():
        if any(not torch.equal(outputs[first], out) for out in outputs.values()):
            raise SystemExit("the forms gave different numbers")
    what = "passes" if args.passes else f"attention ({LAYERS} layers, {args.rows} rows each)"
    print(f"{what}: {args.sequences} sequences x {args.context} positions, {args.threads} threads")
    base = statistics.median(times[second])
    for name, spent in times.items():
        median = statistics.median(spent)
        print(f"  {name:18} median {median * 1e3:7.2f} ms  best {min(spent) * 1e3:7.2f} ms  {median / base:.3f}x")


if __name__ == "__main__":
    main()
