"""What this machine allows a forward pass: the bytes it must read against the memory's read rate, the multiply-adds
it must make against the float32 GEMM's rate, each measured here (a roofline).

Multi-token prediction pays where a pass over n tokens costs about what a pass over one costs. Whether that can hold
on a machine is a property of the machine before it is one of the kernels: a pass of the default model reads ~110 MB
of weights (its quantization blocks) and makes ~134M multiply-adds a row, so where memory streams ~23 GB/s and
torch's float32 GEMM makes ~62 G multiply-adds a second (2 Zen 3 cores, AVX2), a one-token pass at those rates takes
~5 ms and an 8-token one ~18 ms: 3.4x. The AVX kernels multiply exact float32 products with the same fused
multiply-adds the GEMM uses and do not beat its rate (the VNNI and AMX record paths multiply in integers and can).
``agent-mtp measure-machine`` prints the passes at the rates beside the passes measured, so the cost curve the
planner reads can be judged against what the hardware allows (docs/architecture.md).

Run on the engine's compute thread (``threads.compute().run``): the rates are those of its OpenMP pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agent_mtp.engine.fast.weights import fastest

if TYPE_CHECKING:
    from agent_mtp.engine.fast.model import FastModel

READ_MIB = 256
"""Size of the tensor the read rate streams: well past any CPU's caches."""
GEMM_SIZE = 512
"""Side of the square float32 matrices the GEMM rate multiplies: 1 MiB each, in the L2 / L3 caches."""
PASS_ROWS = (1, 2, 4, 8, 16)
"""Pass sizes the roofline measures and gives at the rates."""


@dataclass(frozen=True)
class MachineRates:
    """The two rates a pass's time at the rates divides by, measured on ``threads`` threads."""

    read_gb_s: float
    """Bytes per second (1e9) a sum over a float32 tensor far larger than the caches streams."""
    gemm_gmac_s: float
    """Multiply-adds per second (1e9) of torch's float32 GEMM on matrices that sit in the caches: what the cores'
    vector units give float32 products (the AVX kernels' exact float32 products do not go faster; the VNNI and AMX
    record paths multiply in integers and can)."""
    threads: int


@dataclass(frozen=True)
class PassShape:
    """What a forward pass of a prepared model must read and compute."""

    weight_bytes: int
    """Bytes of weights a one-token pass reads (the quantization blocks where the model keeps them, else the
    float32 or bfloat16 weights); a longer pass reads them once too."""
    row_macs: int
    """Multiply-adds one row costs in the linear layers, output head included."""
    kv_bytes_per_position: int
    """Bytes of keys and values a pass reads per cached position (every layer)."""
    attention_macs_per_position: int
    """Multiply-adds one row's attention costs per cached position (scores and weighted values, every layer)."""

    @classmethod
    def of(cls, model: FastModel) -> PassShape:
        projections = [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        linears = [p.linear for p in projections] + [model.lm_head]
        weight_bytes = sum(lin.blocks.nbytes if lin.blocks is not None else lin.nbytes() for lin in linears)
        # the model's own outputs: an adapter's low-rank rows ride along only in passes with mask rows
        outputs = [p.out_features for p in projections] + [model.lm_head.out_features]
        row_macs = sum(out * lin.in_features for out, lin in zip(outputs, linears, strict=True))
        layers = len(model.layers)
        element = torch.empty(0, dtype=model.kv_dtype).element_size()
        return cls(
            weight_bytes=weight_bytes,
            row_macs=row_macs,
            kv_bytes_per_position=layers * 2 * model.kv_dim * element,
            attention_macs_per_position=layers * 2 * model.q_dim,
        )

    def seconds_at(self, rates: MachineRates, rows: int, context: int) -> float:
        """A pass of ``rows`` new rows over ``context`` cached positions at the machine's rates: its bytes at the read
        rate or its multiply-adds at the GEMM rate, whichever is longer (the two overlap at best)."""
        if rows < 1 or context < 0:
            raise ValueError(f"rows={rows}, context={context}: a pass has at least one row and no negative context.")
        read = (self.weight_bytes + context * self.kv_bytes_per_position) / (rates.read_gb_s * 1e9)
        compute = rows * (self.row_macs + context * self.attention_macs_per_position) / (rates.gemm_gmac_s * 1e9)
        return max(read, compute)


@dataclass(frozen=True)
class Roofline:
    """A prepared model's passes at this machine's rates, with the passes as measured."""

    rates: MachineRates
    shape: PassShape
    context: int
    measured: tuple[tuple[int, float], ...]
    """(rows, seconds): the fastest of a few passes of that many rows (every row's logits read) at ``context``."""

    def at_rates(self, rows: int) -> float:
        return self.shape.seconds_at(self.rates, rows, self.context)

    def ratio_at_rates(self, rows: int) -> float:
        """A ``rows``-row pass at the rates over a one-row pass at the rates."""
        return self.at_rates(rows) / self.at_rates(1)


def _seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure_rates(*, read_mib: int = READ_MIB, gemm_size: int = GEMM_SIZE, rounds: int = 5) -> MachineRates:
    """The read rate and the float32 GEMM rate on torch's threads now (fastest of ``rounds``; an idle machine)."""
    if read_mib < 1 or gemm_size < 8 or rounds < 1:
        raise ValueError(f"read_mib={read_mib}, gemm_size={gemm_size}, rounds={rounds}: each must be positive.")
    block = torch.ones(read_mib * (1 << 20) // 4)
    a = torch.randn(gemm_size, gemm_size)
    b = torch.randn(gemm_size, gemm_size)
    out = torch.empty(gemm_size, gemm_size)
    repeats = 4

    def gemms() -> None:
        for _ in range(repeats):
            torch.mm(a, b, out=out)

    calls: dict[str, Callable[[], object]] = {"read": block.sum, "gemm": gemms}
    best = fastest(tuple(calls), lambda name, _: _seconds(calls[name]), 0, rounds)  # after a warm-up call each
    read, gemm = best["read"], best["gemm"]
    return MachineRates(
        read_gb_s=read_mib * (1 << 20) / read / 1e9,
        gemm_gmac_s=repeats * gemm_size**3 / gemm / 1e9,
        threads=torch.get_num_threads(),
    )


def measure_passes(
    model: FastModel, *, context: int, rows: Sequence[int] = PASS_ROWS, rounds: int = 5
) -> tuple[tuple[int, float], ...]:
    """The fastest of ``rounds`` passes of each size in ``rows`` (the sizes alternating; token ids from 3 up to 1000
    or the vocabulary's end, every row's logits read) on a cached prefix of ``context`` tokens, rolled back after
    each."""
    if context < 1 or not rows or min(rows) < 1:
        raise ValueError(f"context={context}, rows={list(rows)}: a prefix of at least one token, rows of at least 1.")
    generator = torch.Generator().manual_seed(0)
    high = min(1000, int(model.embed.shape[0]))
    prefix = [int(t) for t in torch.randint(3, high, (context,), generator=generator)]
    cache = model.new_cache(context + max(rows))
    model.forward(prefix, cache, 1)

    def one_pass(n: int, _: int) -> float:
        tokens = prefix[:n] if n <= context else (prefix * (n // context + 1))[:n]
        start = time.perf_counter()
        model.forward(tokens, cache, n)
        seconds = time.perf_counter() - start
        cache.truncate(context)
        return seconds

    best = fastest(tuple(rows), one_pass, 0, rounds)  # sizes alternate, each after a warm-up pass
    return tuple((n, best[n]) for n in rows)


def measure_roofline(model: FastModel, *, context: int, rows: Sequence[int] = PASS_ROWS) -> Roofline:
    """Rates, the model's pass shape and its passes, measured now (~2 s for the default model on 2 cores)."""
    return Roofline(
        rates=measure_rates(),
        shape=PassShape.of(model),
        context=context,
        measured=measure_passes(model, context=context, rows=rows),
    )
