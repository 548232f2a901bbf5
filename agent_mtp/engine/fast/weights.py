"""Weights prepared once for the fast runtime: fused, reordered and pre-packed GEMM operands.

On a CPU a plain ``F.linear`` over 2-16 rows costs 2-3x one row; the same weights pre-packed once for oneDNN cost
~1-1.5x (ARCHITECTURE.md section 5), which is what makes a multi-token pass nearly as cheap as a one-token pass.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F

from agent_mtp.engine.fast import blockq

log = logging.getLogger("agent_mtp.engine.fast")

PACK_BATCH_HINT = 8
"""Rows oneDNN lays the packed weights out for: measured here, packing for 8 rows is as fast as the default at 1-4
rows and ~8% faster at 8 (a hint of 1 is ~1.5x slower everywhere)."""


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in WEIGHT_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def _reorder(dense: torch.Tensor, hint: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(dense, hint)  # type: ignore[no-any-return]


def _prepacked(dense: torch.Tensor) -> torch.Tensor | None:
    """``dense`` laid out for oneDNN, or None where this CPU's oneDNN cannot pack it (bf16 needs AVX-512 BF16
    or AVX-NE-CONVERT; an AVX2-only CPU runs bf16 weights through ``F.linear``)."""
    try:
        return _reorder(dense, PACK_BATCH_HINT)
    except RuntimeError as e:
        _warn_unpacked(str(dense.dtype), str(e).splitlines()[0])
        return None


@functools.cache
def _warn_unpacked(dtype: str, reason: str) -> None:
    log.warning(
        "oneDNN cannot pre-pack %s weights on this CPU (%s): they run through F.linear, which is slower than "
        "packed float32 here; use dtype float32.",
        dtype,
        reason,
    )


class PackedLinear:
    """``y = x W^T + b`` with ``W`` pre-packed for oneDNN once (plain ``F.linear`` where oneDNN cannot run).

    Inputs and outputs are float32. bfloat16 weights (half the bytes to read per pass) get their input rounded to
    bfloat16 for the GEMM (accumulated in float32 by oneDNN); the bias is added in float32. float32 weights that are
    exactly GGUF quantization blocks (the default model's) are also kept as blocks, which passes of up to
    :attr:`block_rows` rows read instead (same weights, ~5x fewer bytes; :mod:`agent_mtp.engine.fast.blockq`)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        prepack: bool = True,
        blocks: bool = True,
        extra_rows: torch.Tensor | None = None,
    ) -> None:
        """``extra_rows`` [r, in] (float32, e.g. an adapter's low-rank factor) are appended to ``weight``: the
        output is [n, out + r] on every path."""
        self.blocks = blockq.block_weights(weight) if blocks else None
        self.extra_rows = extra_rows.float().contiguous() if extra_rows is not None else None
        if extra_rows is not None:
            weight = torch.cat([weight, extra_rows.to(weight.dtype)])
            if bias is not None:
                bias = torch.cat([bias, bias.new_zeros(extra_rows.shape[0])])
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.dtype = weight.dtype
        self.bias = bias.detach().float().contiguous() if bias is not None else None
        self.weight = weight.detach().contiguous()
        self.packed = False
        """Whether :attr:`weight` is laid out for oneDNN (:meth:`pack`)."""
        self._pack_pending = prepack and _can_prepack(weight)
        if self.blocks is None:  # every pass reads the float32 weights: pack them now
            self.pack()
        self.block_rows = blockq.MAX_ROWS
        """Passes of up to this many rows read the blocks (the fast model sets its measured crossover)."""
        self._dense_bytes = self.out_features * self.in_features * self.weight.element_size()
        self.dense_released = False
        """Whether :meth:`release_dense` dropped the float32 copy (every pass reads the blocks)."""

    def pack(self) -> None:
        """Lay the float32 (or bfloat16) weights out for oneDNN, once (``prepack``). Where the linear has blocks this
        waits until a pass, a measurement or the fast model asks (:meth:`dense_product`): where the blocks serve every
        pass, as the machine's stored crossover often says, the copy is never made (0.37 s of the default model's
        preparation on Zen 4, and 0.5 GB held until :meth:`release_dense`)."""
        if self._pack_pending:
            self._pack_pending = False
            packed = _prepacked(self.weight)
            if packed is not None:
                self.weight, self.packed = packed, True

    def reads_blocks(self, rows: int) -> bool:
        """Whether a pass of ``rows`` rows reads the quantization blocks (else the float32 weights)."""
        return self.blocks is not None and rows <= self.block_rows

    def nbytes(self) -> int:
        """Bytes of the float32 (or bfloat16) weights a float32 GEMM pass reads."""
        return self._dense_bytes

    def release_dense(self) -> int:
        """Serve every pass from the blocks and drop the float32 (pre-packed) weights, where the blocks won at every
        row count measured (:data:`BLOCKS_EVERY_PASS`); returns the bytes of the copy this linear held (0 without
        blocks, or where it shared the model's own tensor, which the model keeps)."""
        if self.blocks is None or self.dense_released:
            return 0
        owned = self.packed or self.extra_rows is not None  # a pre-packed copy, or the weights joined with extra rows
        self.block_rows = BLOCKS_EVERY_PASS
        self.weight = self.weight.new_empty(0)
        self._pack_pending = False
        self.dense_released = True
        return self._dense_bytes if owned else 0

    def add_into(
        self, residual: torch.Tensor, x: torch.Tensor, coarse: Sequence[int] = (), *, grid_bits: int = 24
    ) -> torch.Tensor | None:
        """``residual[:, :out] += x W^T + b`` in place (fused into the kernel on block passes); returns the
        ``extra_rows``' products [n, r] (None without extra rows). ``coarse``, ``grid_bits``: as for
        :meth:`__call__`."""
        blocks = self.blocks
        if blocks is not None and blocks.accumulates and self.reads_blocks(x.shape[0]):
            extra = blocks.add_into(residual, x, self.extra_rows, coarse, grid_bits=grid_bits)
            if self.bias is not None:
                residual.add_(self.bias[: blocks.out_features])
            return extra if self.extra_rows is not None else None
        y = self(x)
        width = residual.shape[1]
        residual.add_(y[:, :width])
        return y[:, width:] if self.extra_rows is not None else None

    def __call__(
        self, x: torch.Tensor, norm: blockq.Norm | None = None, coarse: Sequence[int] = (), *, grid_bits: int = 24
    ) -> torch.Tensor:
        """x [n, in] (float32) -> [n, out] (float32); with ``norm`` (weight, eps) the input is ``rms_norm(x) *
        weight`` (normalised inside the kernel on block passes). ``coarse``: rows (flattened [start, stop) runs)
        that block passes on the record paths may compute on an 8-bit input grid (:meth:`BlockWeights.__call__`);
        the float32 GEMM computes them exactly. ``grid_bits``: the other rows' grid there (24 or 16, see
        :meth:`BlockWeights.__call__`)."""
        if self.reads_blocks(x.shape[0]):
            return self.blocks_product(x, norm, coarse, grid_bits=grid_bits)
        return self.dense_product(x, norm)

    def screens(self, rows: int) -> bool:
        """Whether a pass of ``rows`` rows could screen greedy rows (:meth:`screened`)."""
        return self.reads_blocks(rows) and self.blocks is not None and self.blocks.screens

    def screened(
        self,
        x: torch.Tensor,
        screen: Sequence[int],
        norm: blockq.Norm | None = None,
        coarse: Sequence[int] = (),
        *,
        grid_bits: int = 24,
    ) -> tuple[torch.Tensor, int]:
        """:meth:`__call__` with the rows of ``screen`` (flattened [start, stop) runs) read only for their argmax:
        where the blocks can (:meth:`screens`), those rows are multiplied on the 8-bit grid and the outputs that could
        be their argmax recomputed exactly (:meth:`BlockWeights.screened`: the same argmax, the other outputs lower
        approximations); else every row is exact. Returns (y, record streams recomputed)."""
        if not (screen and self.screens(x.shape[0])):
            return self(x, norm, coarse, grid_bits=grid_bits), 0
        assert self.blocks is not None
        y, recomputed = self.blocks.screened(x, screen, self.extra_rows, norm, coarse, grid_bits=grid_bits)
        return (y.add_(self.bias) if self.bias is not None else y), recomputed

    def blocks_product(
        self, x: torch.Tensor, norm: blockq.Norm | None = None, coarse: Sequence[int] = (), *, grid_bits: int = 24
    ) -> torch.Tensor:
        """:meth:`__call__` on the quantization blocks, whatever the number of rows."""
        assert self.blocks is not None
        y = self.blocks(x, self.extra_rows, norm, coarse, grid_bits=grid_bits)
        return y.add_(self.bias) if self.bias is not None else y

    def dense_product(self, x: torch.Tensor, norm: blockq.Norm | None = None) -> torch.Tensor:
        """:meth:`__call__` on the float32 (or bfloat16) weights, whatever the number of rows."""
        if self.dense_released:
            msg = (
                "This linear's float32 weights were released (its blocks serve every pass); call blocks_product, "
                "or prepare the model with blocks=False for a float32-only runtime."
            )
            raise RuntimeError(msg)
        self.pack()
        if norm is not None:
            x = F.rms_norm(x, (x.shape[-1],), norm[0], norm[1])
        if self.dtype == torch.float32:
            if self.packed:
                return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return F.linear(x, self.weight, self.bias)
        low = x.to(self.dtype)
        if self.packed:
            y = torch.ops.mkldnn._linear_pointwise(low, self.weight, None, "none", [], "").float()
        else:
            y = F.linear(low, self.weight).float()
        return y.add_(self.bias) if self.bias is not None else y


CROSSOVER_CANDIDATES = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 31, 48, 64, 96, 128, 192, 256)
"""Row counts at which :func:`measure_block_rows` compares the two weight paths. The blocks can beat the float32 GEMM
up to a few hundred rows (a prefill, a batch of many sequences): on AMX their passes multiply tile records, on AVX2
passes of 9+ rows multiply weights rebuilt once into a buffer at what the multiply-add pipes allow (Zen 3: blocks
ahead at every candidate, 256 rows 45.9 against 54.9 ms)."""
LONG_PASS_ROWS = 48
"""Candidates from here on are timed once per path (their passes are long enough not to need the fastest of three)."""
BLOCKS_EVERY_PASS = 1 << 30
"""The crossover where the blocks won at every candidate: every pass reads them (their speed per row is flat from a
few tens of rows on, as the GEMM's is)."""
CROSSOVER_BYTES = 64 << 20
"""Float32 bytes of weights a crossover measurement multiplies per round: past every CPU cache, as in a real pass."""


def _crossover_sample(linears: Sequence[PackedLinear]) -> list[PackedLinear]:
    """The first block linears up to :data:`CROSSOVER_BYTES` of float32 weights (enough to stream from memory)."""
    chosen: list[PackedLinear] = []
    taken = 0
    for linear in linears:
        if linear.blocks is not None and taken < CROSSOVER_BYTES:
            chosen.append(linear)
            taken += linear.nbytes()
    return chosen


FORM_BYTES = 128 << 20
"""Bytes of blocks (both layouts) a kernel-form measurement reads per round: past every CPU cache, as in a real pass
(a smaller sample sat in a 32 MiB L3 and picked the form that loses on a whole pass)."""


def _form_sample(linears: Sequence[PackedLinear]) -> list[PackedLinear]:
    """Block linears of every quantization kind (the Q8_0 output head beside the Q4_1 layers: their kernels differ),
    then the others in order, up to :data:`FORM_BYTES` of blocks."""
    blocked = [x for x in linears if x.blocks is not None]
    firsts: dict[str, PackedLinear] = {}
    for linear in blocked:
        assert linear.blocks is not None
        firsts.setdefault(linear.blocks.kind, linear)
    chosen = list(firsts.values())
    taken = sum(_block_bytes(x) for x in chosen)
    for linear in blocked:
        if taken >= FORM_BYTES:
            break
        if all(linear is not x for x in chosen):
            chosen.append(linear)
            taken += _block_bytes(linear)
    return chosen


def _random_inputs(linears: Sequence[PackedLinear], rows: int) -> dict[int, torch.Tensor]:
    """Seeded random inputs [rows, in_features] for each input width of ``linears`` (the measurements' rows)."""
    widths = {x.in_features for x in linears}
    return {w: torch.randn(rows, w, generator=torch.Generator().manual_seed(0)) for w in widths}


def _block_bytes(linear: PackedLinear) -> int:
    blocks = linear.blocks
    assert blocks is not None
    return blocks.nbytes + (blocks.lanes.numel() if blocks.lanes is not None else 0)


_T = TypeVar("_T")


def fastest(choices: Sequence[_T], timed: Callable[[_T, int], float], rows: int, rounds: int) -> dict[_T, float]:
    """The fastest of ``rounds`` timings ``timed(choice, rows)`` of each choice, the choices alternating after one
    warm-up call each."""
    best = dict.fromkeys(choices, math.inf)
    for choice in choices:
        timed(choice, rows)
    for _ in range(rounds):
        for choice in choices:
            best[choice] = min(best[choice], timed(choice, rows))
    return best


WIDE_ROWS = {blockq.Wide.ROWS: (1, 2, 4), blockq.Wide.LANES: (8,)}
"""Pass sizes at which each kernel class's AVX-512 and AVX2 forms are timed against each other: one-token and short
drafted passes (row kernels), a longer drafted or batched one (lane kernels)."""


def measure_avx512(linears: Sequence[PackedLinear], *, rounds: int = 3) -> blockq.Wide:
    """The kernel classes whose AVX-512 forms multiply ``linears`` faster than their AVX2 forms here, each summed over
    its :data:`WIDE_ROWS` (fastest of ``rounds``, the forms alternating). Both give the same bits, so the faster form
    of each class can serve the whole process: both faster by 1.2-1.5x on a Sapphire-Rapids-class Xeon; on Zen 4
    (512-bit instructions split in two) the row kernels gain up to 1.1x at 2-3 rows and the lane kernels 4-10%, and
    before its Q8_0 lane kernel was fixed that class lost 15% there. None where the CPU has no AVX-512 forms. Run it
    on the thread that runs passes."""
    chosen = _form_sample(linears)
    with blockq.avx512(True) as wide:
        if not wide or not chosen:
            return blockq.Wide.ALL if wide else blockq.Wide.NONE
    inputs = _random_inputs(chosen, max(max(s) for s in WIDE_ROWS.values()))

    def timed(form: blockq.Wide, rows: int) -> float:
        with blockq.avx512(form), blockq.vnni(False):  # the AVX kernels' forms (they serve where VNNI is off)
            start = time.perf_counter()
            for linear in chosen:
                linear.blocks_product(inputs[linear.in_features][:rows])
            return time.perf_counter() - start

    faster = blockq.Wide.NONE
    for kernels, sizes in WIDE_ROWS.items():
        totals = dict.fromkeys((kernels, blockq.Wide.NONE), 0.0)
        for rows in sizes:
            best = fastest(tuple(totals), timed, rows, rounds)
            log.debug(
                "%s at %d rows: AVX-512 %.2f ms, AVX2 %.2f ms",
                kernels.name,
                rows,
                1e3 * best[kernels],
                1e3 * best[blockq.Wide.NONE],
            )
            for form in best:
                totals[form] += best[form]
        if totals[kernels] <= totals[blockq.Wide.NONE]:
            faster |= kernels
    return faster


BUFFERED_SIZES = (6, 8)
"""Pass sizes at which :func:`measure_buffered_rows` times AVX2 lane passes in tiles against buffered."""


def measure_buffered_rows(linears: Sequence[PackedLinear], *, rounds: int = 2) -> int:
    """:data:`blockq.BUFFERED_LOW_ROWS` where AVX2 lane passes of :data:`BUFFERED_SIZES` rows multiply ``linears``'
    blocks faster on the buffered path than in lane tiles (summed over the sizes, fastest of ``rounds``, the paths
    alternating), else :data:`blockq.BUFFERED_ROWS`. Both give the same bits. Zen 3 (two 256-bit FMA pipes): tiles
    34 against buffered 29 GMAC/s at 8 rows; Zen 1 (128-bit pipes): whole passes of 5 / 6 / 8 rows 0.96x / 0.95x /
    0.90x the time buffered. Run it on the thread that runs passes, after the AVX-512 forms are settled."""
    chosen = _form_sample(linears)
    if not chosen or blockq.avx512_forms() & blockq.Wide.LANES or blockq.records_active():
        return blockq.BUFFERED_ROWS  # passes never take the AVX2 lane kernels here
    inputs = _random_inputs(chosen, max(BUFFERED_SIZES))

    def timed(threshold: int, rows: int) -> float:
        with blockq.buffered_from(threshold):
            start = time.perf_counter()
            for linear in chosen:
                linear.blocks_product(inputs[linear.in_features][:rows])
            return time.perf_counter() - start

    paths = (blockq.BUFFERED_LOW_ROWS, blockq.BUFFERED_ROWS)
    totals = dict.fromkeys(paths, 0.0)
    for rows in BUFFERED_SIZES:
        best = fastest(paths, timed, rows, rounds)
        log.debug("%d rows: buffered %.2f ms, lane tiles %.2f ms", rows, 1e3 * best[paths[0]], 1e3 * best[paths[1]])
        for path in paths:
            totals[path] += best[path]
    return (
        blockq.BUFFERED_LOW_ROWS
        if totals[blockq.BUFFERED_LOW_ROWS] < totals[blockq.BUFFERED_ROWS]
        else blockq.BUFFERED_ROWS
    )


TILE_ROWS_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
"""Pass sizes at which :func:`measure_tile_rows` times the AMX tiles against VNNI."""


def measure_tile_rows(linears: Sequence[PackedLinear], *, rounds: int = 2) -> blockq.TileRows:
    """From which pass sizes the AMX tiles multiply ``linears``' blocks faster than VNNI: passes of exact rows, and
    drafted passes (one exact row, then draft-only rows on the 8-bit grid, as ``verified``'s). Every candidate of
    :data:`TILE_ROWS_CANDIDATES` is timed on both paths, and the split kept is the one that costs least over all of
    them (:func:`_best_split`): near the crossing the two paths differ by a few percent, less than a machine's noise
    between samples, and a scan that stopped at the first wins moved the split between 6 and 16 rows from one
    process to the next. The two paths give the same bits, so the faster one may serve each pass.

    A tile product costs about the same for 1-8 rows, VNNI's byte products grow with every row (an exact row's three
    per weight, a draft-only row's one): on a 2-core Sapphire-Rapids-class VM VNNI was 1.4x faster at one row, the
    two met at 6-8 exact rows, the tiles were 1.3x faster at 16, and VNNI stayed faster for drafted passes up to 32
    rows. Each round multiplies the sample of :func:`_form_sample` (past every CPU cache, as in a pass) on both paths
    alternately; the fastest of ``rounds`` counts. Run it on the thread that runs passes (~1 s)."""
    chosen = _form_sample(linears)
    if not chosen:
        return blockq.TILES_EVERY_PASS
    inputs = _random_inputs(chosen, max(TILE_ROWS_CANDIDATES))

    def timed(tiles: bool, rows: int, drafted: bool) -> float:
        coarse = [1, rows] if drafted and rows > 1 else []
        with blockq.tiles_from(blockq.TILES_EVERY_PASS if tiles else blockq.TILES_NEVER):
            start = time.perf_counter()
            for linear in chosen:
                linear.blocks_product(inputs[linear.in_features][:rows], None, coarse)
            return time.perf_counter() - start

    timed(True, 1, False)  # warm-up: first-touch pages, the tile configuration
    timed(False, 1, False)

    def split(drafted: bool) -> int:
        sizes = TILE_ROWS_CANDIDATES[1:] if drafted else TILE_ROWS_CANDIDATES  # a drafted pass has 2+ rows
        on_tiles, on_vnni = [math.inf] * len(sizes), [math.inf] * len(sizes)
        for _ in range(rounds):
            for i, rows in enumerate(sizes):
                on_tiles[i] = min(on_tiles[i], timed(True, rows, drafted))
                on_vnni[i] = min(on_vnni[i], timed(False, rows, drafted))
        for rows, a, b in zip(sizes, on_tiles, on_vnni, strict=True):
            kind = "drafted" if drafted else "exact"
            log.debug("%s passes of %d rows: tiles %.2f ms, VNNI %.2f ms", kind, rows, 1e3 * a, 1e3 * b)
        return _best_split(sizes, on_tiles, on_vnni)

    exact = split(drafted=False)
    if exact <= 1:
        return blockq.TILES_EVERY_PASS
    return blockq.TileRows(exact, max(exact, split(drafted=True)))


def _best_split(sizes: Sequence[int], on_tiles: Sequence[float], on_vnni: Sequence[float]) -> int:
    """The size from which the tiles should serve (VNNI below it) that costs least summed over ``sizes``, each
    size's times relative to its mean (so that long passes do not outweigh short ones); twice the largest size
    where VNNI should serve all of them. Ties go to the smaller size."""
    relative = [(t / ((t + v) / 2), v / ((t + v) / 2)) for t, v in zip(on_tiles, on_vnni, strict=True)]
    candidates = [*sizes, 2 * max(sizes)]
    costs = [sum(v for _, v in relative[:i]) + sum(t for t, _ in relative[i:]) for i in range(len(candidates))]
    return candidates[costs.index(min(costs))]


def measure_block_rows(linears: Sequence[PackedLinear], *, rounds: int = 3) -> int:
    """The largest of :data:`CROSSOVER_CANDIDATES` at which reading the blocks is at least as fast as the float32
    GEMM, scanning upwards until the blocks lose at two candidates in a row (one noisy loss does not end the scan);
    1 if they lose at 2 and 3 rows; :data:`BLOCKS_EVERY_PASS` if they lost at none.

    Each round multiplies random rows by ``linears`` in turn until :data:`CROSSOVER_BYTES` of float32 weights have
    been read (they stream from memory, as in a pass), on both paths alternately; the fastest of ``rounds`` counts.
    Run it on the thread that will run the passes (its OpenMP pool is the one that is timed)."""
    chosen = _crossover_sample(linears)
    if not chosen:
        return blockq.MAX_ROWS
    inputs = _random_inputs(chosen, max(CROSSOVER_CANDIDATES))

    def timed(blocks: bool, rows: int) -> float:
        start = time.perf_counter()
        for linear in chosen:
            x = inputs[linear.in_features][:rows]
            if blocks:
                linear.blocks_product(x)
            else:
                linear.dense_product(x)
        return time.perf_counter() - start

    timed(True, 1)  # warm-up: first-touch pages, oneDNN primitives
    timed(False, 1)
    best, losses, lost = 1, 0, False
    for rows in CROSSOVER_CANDIDATES:
        on_blocks = on_dense = math.inf
        # passes of 48+ rows take 10-50 ms on each path here, past the timer's noise: one round each (the scan took
        # 0.8 s instead of 1.4 with three on Zen 3)
        for _ in range(rounds if rows < LONG_PASS_ROWS else 1):
            on_blocks = min(on_blocks, timed(True, rows))
            on_dense = min(on_dense, timed(False, rows))
        log.debug("crossover: %d rows, blocks %.2f ms, float32 %.2f ms", rows, 1e3 * on_blocks, 1e3 * on_dense)
        losses = losses + 1 if on_blocks > on_dense else 0
        lost = lost or losses > 0
        if losses == 2:
            break
        if not losses:
            best = rows
    return BLOCKS_EVERY_PASS if not lost else best


LowRankFactors = tuple[torch.Tensor, torch.Tensor]
"""A gated adapter's delta for one fused GEMM: ``A`` [R, in] and ``B^T`` [R, out] with the LoRA scale folded in."""
MaskRuns = Sequence[slice]
"""The rows of a pass that hold mask tokens, as runs of consecutive rows (each sequence's tail, in a batch)."""


def flat_runs(rows: MaskRuns) -> list[int]:
    """Mask runs as the flattened [start, stop) pairs the C++ kernels take."""
    return [bound for run in rows for bound in (run.start, run.stop)]


class Projection:
    """One fused, packed GEMM that may carry a gated adapter: ``y = x W^T + b``, plus ``(x A^T) B^T`` at mask rows.

    ``A`` rides in the same packed GEMM as extra output columns (``[W; A]``, ~1% more bytes), so the adapter costs
    one small product per projection (``low_rank_add``), and only on passes that carry mask rows."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        lora: LowRankFactors | None = None,
        *,
        prepack: bool = True,
        blocks: bool = True,
    ) -> None:
        self.out_features = int(weight.shape[0])
        self.a: torch.Tensor | None = None
        self.b_t: torch.Tensor | None = None
        self.b_draft: torch.Tensor | None = None
        """``B^T`` in bfloat16, for mask rows that are only drafts (``coarse``): half the bytes a masked pass reads
        for the delta, and a draft's numbers need not be exact (``verified`` checks every drafted token)."""
        self.b_spans: torch.Tensor | None = None
        """Per 64 outputs, the rank rows of ``B^T`` that are not all zero (a fused projection's ``B^T`` is block
        diagonal): the kernel reads only those (:func:`low_rank_spans`)."""
        if lora is not None:
            a, b_t = lora
            if a.shape[0] % 2:  # an even row stride keeps complex views (RoPE) of the output possible
                a = torch.cat([a, a.new_zeros(1, a.shape[1])])
                b_t = torch.cat([b_t, b_t.new_zeros(1, b_t.shape[1])])
            self.a = a.float().contiguous()
            self.b_t = b_t.float().contiguous()
            self.b_draft = self.b_t.to(torch.bfloat16)
            self.b_spans = low_rank_spans(self.b_t)
        self.linear = PackedLinear(weight, bias, prepack=prepack, blocks=blocks, extra_rows=self.a)

    def __call__(
        self,
        x: torch.Tensor,
        rows: MaskRuns,
        norm: blockq.Norm | None = None,
        coarse: MaskRuns = (),
        *,
        grid_bits: int = 24,
    ) -> torch.Tensor:
        """x [n, in] -> [n, out]; ``rows``: the mask rows as runs of consecutive rows (or empty); ``norm``: an RMS
        norm (weight, eps) applied to x first; ``coarse``: the mask rows whose products are only drafts (computed
        on an 8-bit input grid where the record paths serve the pass); ``grid_bits``: the other rows' grid there
        (24 or 16, see :meth:`~agent_mtp.engine.fast.blockq.BlockWeights.__call__`)."""
        y = self.linear(x, norm, flat_runs(coarse), grid_bits=grid_bits)
        if self.b_t is None:
            return y
        out = self.out_features
        self._add_low_rank(y[:, :out], y[:, out:], rows, coarse)
        return y[:, :out]

    def add_into(
        self, residual: torch.Tensor, x: torch.Tensor, rows: MaskRuns, coarse: MaskRuns = (), *, grid_bits: int = 24
    ) -> None:
        """``residual += self(x, rows, coarse=coarse, grid_bits=grid_bits)`` in place: the GEMM adds into the
        residual (in the kernel on block passes), then the adapter's delta is added at the mask rows."""
        low = self.linear.add_into(residual, x, flat_runs(coarse), grid_bits=grid_bits)
        if self.b_t is None or low is None:
            return
        self._add_low_rank(residual, low, rows, coarse)

    def _add_low_rank(self, target: torch.Tensor, low: torch.Tensor, rows: MaskRuns, coarse: MaskRuns) -> None:
        """``target[run] += low[run] @ B^T`` for every run of mask rows: in one C++ call where the block kernels are
        loaded (the one the fused layer pass makes, so both paths give the same numbers; the ``coarse`` runs with
        :attr:`b_draft`), else one addmm per run."""
        assert self.b_t is not None
        if not rows:
            return
        if blockq.enabled() and blockq.kernels_available():
            torch.ops.agent_mtp_blockq.low_rank_add(
                target, low, self.b_t, flat_runs(rows), self.b_draft, self.b_spans, flat_runs(coarse)
            )
            return
        for run in rows:
            target[run].addmm_(low[run], self.b_t)


def low_rank_spans(b_t: torch.Tensor) -> torch.Tensor:
    """Per 64 outputs of ``b_t`` [rank, out], the rank rows [lo, hi) that are not all zero, as int32 [slices, 2]
    (what ``low_rank_add`` reads; lo = hi where a slice has none)."""
    slices = -(-int(b_t.shape[1]) // 64)
    padded = torch.zeros(int(b_t.shape[0]), slices * 64, dtype=torch.bool)
    padded[:, : b_t.shape[1]] = b_t != 0
    nonzero = padded.view(-1, slices, 64).any(-1).t()  # [slices, rank]
    rank = torch.arange(int(b_t.shape[0]))
    hi = torch.where(nonzero, rank + 1, 0).amax(-1)
    lo = torch.where(nonzero, rank, int(b_t.shape[0])).amin(-1)
    return torch.stack([torch.minimum(lo, hi), hi], dim=1).to(torch.int32).contiguous()


def stack_low_rank(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None], out_sizes: Sequence[int]
) -> LowRankFactors | None:
    """Fuse the (A [r, in], B [out, r], scale) factors of the parts of one GEMM; None where no part has any.

    The parts' ``A`` are stacked [sum r, in] and ``B^T`` is block diagonal [sum r, sum out], so one small GEMM
    serves the whole fused projection."""
    present = [p for p in parts if p is not None]
    if not present:
        return None
    in_features = int(present[0][0].shape[1])
    total_rank = sum(int(p[0].shape[0]) for p in present)
    a = torch.zeros(total_rank, in_features, dtype=torch.float32)
    b = torch.zeros(sum(out_sizes), total_rank, dtype=torch.float32)
    r0, o0 = 0, 0
    for part, size in zip(parts, out_sizes, strict=True):
        if part is not None:
            lora_a, lora_b, scale = part
            r = int(lora_a.shape[0])
            a[r0 : r0 + r] = lora_a.detach().float()
            b[o0 : o0 + size, r0 : r0 + r] = lora_b.detach().float() * scale
            r0 += r
        o0 += size
    return a, b.t().contiguous()


def rope_pair_order(num_heads: int, head_dim: int) -> torch.Tensor:
    """Row order that puts the two halves HF's ``rotate_half`` pairs up (i, i + d/2) next to each other in every head,
    so RoPE becomes one complex multiply. q and k are reordered alike, so q . k (and attention) is unchanged."""
    half = head_dim // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)  # [d]: 0, d/2, 1, ...
    return (torch.arange(num_heads)[:, None] * head_dim + within[None, :]).reshape(-1)
