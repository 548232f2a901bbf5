"""Linear layers that read a GGUF model's quantization blocks instead of its float32 copy, computing in float32.

The default model ships as a Q4_1 GGUF file: every decoder weight is ``d * q + m`` for a 4-bit ``q`` and per-block
(32 weights) float16 ``d`` and ``m``, and the tied embedding is Q8_0 (``d * q``, 8-bit ``q``). The float32 model the
engine loads holds exactly those values, so the blocks can be recovered from it (and checked bit for bit), and a
kernel that rebuilds each weight in float32 from its block reads 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight instead
of 4, for identical weights. A one-token pass is bound by the bytes it reads, so its linear layers take less than
half the time of the pre-packed float32 GEMM here; past a few rows the float32 GEMM is faster (the rebuild is paid
per block of rows), so :class:`BlockWeights` is used for passes of up to a crossover measured on the machine
(:data:`MAX_ROWS`, ``docs/benchmarks.md``).

Every output of the kernel is one fixed sequence of float32 operations, whatever the number of rows, so a row's
result does not depend on the rows beside it. The kernels are C++ (AVX2 + FMA, and AVX-512 forms giving the same
bits, chosen at run time where the CPU has them) compiled once per machine into the cache directory with the system
compiler; where that is impossible the fast runtime keeps the float32 GEMM.

Where the CPU has AMX-INT8 (Sapphire Rapids and later Xeons) block passes multiply on the AMX tiles instead:
each row's block of inputs on a 24-bit fixed-point grid, exact integer sums against the quants, float32 scaling
(float32-accurate, a row's numbers the same at every pass size; :data:`AMX_ENV`, :func:`amx`, docs/architecture.md);
such CPUs also have AVX-512 VNNI, which computes the same bits from the same records and is the faster of the two
for short passes, so those take VNNI (:data:`AMX_ROWS_ENV`, :func:`settle_tile_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_mtp.errors import ConfigError

log = logging.getLogger("agent_mtp.engine.fast")

MAX_ROWS = 4
"""Passes of at most this many rows read the blocks, longer ones the pre-packed float32 weights, where the crossover
is not measured (models small enough to sit in the CPU caches) or pinned (:data:`ROWS_ENV`). For larger models the
fast runtime measures it once per process (:func:`agent_mtp.engine.fast.weights.measure_block_rows`): it depends on
the machine's memory bandwidth against its arithmetic (measured on two machines of the same kind: 4 rows on one,
16-31 on the other, where the float32 GEMM ran at less than half the bandwidth)."""
ROWS_ENV = "AGENT_MTP_BLOCK_ROWS"
"""Set to a whole number to pin the crossover (0: never read the blocks) instead of measuring it."""
LANE_ROWS = {"q4_1": 5, "q8_0": 2}
"""Passes of at least this many rows take the lane kernels, per kind of block (``kLaneRows`` of ``Q41Lanes`` and
``Q80Lanes`` in kernels/blockq.cpp): 8 output features per vector, one rebuilt weight vector for every row of a
tile; shorter passes the row kernels, which unpack 32 weights at a time (a one-token pass is bound by memory). Q4_1's
row kernels stay faster up to 4 rows (1.10-1.20x at 2-4 rows, the decoder's four products on Zen 3); Q8_0's lose
from 2 rows (the output head: 1.12x / 1.8x / 1.9x slower than its lane kernels at 2 / 3 / 4 rows, Zen 3). Each class
gives a row the same numbers whatever the pass size; between the classes only the summation order differs."""
BLOCK = 32
GROUP = 8
"""Output features stored together, block-interleaved, so a kernel reads one contiguous stream per group."""
MAX_EXCEPTION_SHARE = 0.01
"""Rows that are not block-structured (e.g. an embedding row added for the mask token) are computed in float32
beside the kernel; more than this share of them means the tensor is not a quantized one."""
ENV_SWITCH = "AGENT_MTP_BLOCK_WEIGHTS"
"""Set to 0 to keep the float32 GEMM everywhere (the kernels are then neither compiled nor loaded)."""
AVX512_ENV = "AGENT_MTP_AVX512"
"""Set to 0 to keep the AVX2 kernels on a CPU with AVX-512, to 1 to use the AVX-512 forms of both kernel classes
without timing them, to ``rows`` or ``lanes`` for one class only (unset: each class's faster form is measured once
per process on the first large model, :func:`settle_avx512`). The numbers are the same bits either way; the AVX-512
forms rebuild twice the weights per instruction: 1.2-1.5x faster per product on a Sapphire-Rapids-class Xeon, 1.0-1.2x
on Zen 4 (which splits 512-bit instructions in two)."""


GRID_BITS = (24, 16)
"""Bits of the grid on which the record paths (AMX, VNNI) put an exact row's inputs, per block of 32: 24 (the
default: float32-accurate, a row's outputs within float32 rounding of the float32 model's) or 16 (2^-15 of the
block's largest |x|: outputs ~1e-5 of their scale off, so greedy output may differ from the float32 model's at
near-ties; on VNNI an exact row then costs 16 integer products a block instead of 24, which passes of many rows
are bound by). The fast model's ``grid_bits`` (``MTPEngine(grid_bits=...)``, ``AGENT_MTP_GRID_BITS``)."""

AMX_ENV = "AGENT_MTP_AMX"
"""Set to 0 to keep the AVX kernels on a CPU with AMX-INT8 (unset or 1: block passes multiply on AMX tiles, the short
ones on VNNI where the CPU has it too, :data:`AMX_ROWS_ENV`; :func:`tiles_active`)."""
VNNI_ENV = "AGENT_MTP_VNNI"
"""Set to 0 to keep the AVX kernels on a CPU with AVX-512 VNNI but no AMX (unset or 1: every block pass multiplies the
tile records with VNNI's byte products, :func:`vnni_active`: the tiles' numbers)."""
BUFFERED_ROWS = 9
"""AVX2 lane passes of this many rows or more multiply weights rebuilt once per task into a buffer, shorter ones in
lane tiles that rebuild them per tile (``g_buffered_rows`` in kernels/blockq.cpp; the same bits either way). From 9
rows the buffered path was as fast (Zen 3) or faster (Zen 1: 0.75x the pass time at 10-12 rows) on every machine
measured; at 5-8 rows it depends on the machine, so :func:`settle_buffered_rows` measures it once per process."""
BUFFERED_LOW_ROWS = 5
"""Where buffered passes were the faster at 5-8 rows, they serve from here (the lane kernels' first pass size)."""
VNNI_TAIL_ROWS = 2
"""Where AMX and VNNI are both on, an exact tile pass's last chunk of at most this many rows runs on VNNI beside the
tiles' full chunks of 8 (``g_tail_rows`` in kernels/blockq.cpp; :func:`vnni_tail`). A tile chunk costs about the
same for 1 or 8 rows, so a 9th row cost a second chunk: 8 sequences x 1 row 28.0 ms a pass, one row more 33.2 ms on
the tiles alone, 31.1 with it on VNNI; 2 rows more 32.8 -> 31.7, 3 or 4 rows more nothing (2-core
Sapphire-Rapids-class VM, same bits)."""
AMX_ROWS_ENV = "AGENT_MTP_AMX_ROWS"
"""Where the CPU has both AMX-INT8 and AVX-512 VNNI: ``N`` or ``N,M``: passes of N exact rows or more multiply on the
AMX tiles and shorter ones with VNNI's byte products; a drafted pass (one exact row, then draft-only rows on the
8-bit grid, as ``verified``'s masks) goes to the tiles from M rows (default N). Both paths give the same bits. 0: the
tiles serve every pass. Unset: measured once per process on the first large model (:func:`settle_tile_rows`); until
then the tiles serve every pass."""
ROW_WEIGHT = 1024
"""An exact row's weight in the kernels' pass weights (``tiles_from`` in kernels/blockq.cpp)."""


@dataclass(frozen=True)
class TileRows:
    """From which pass sizes the AMX tiles, rather than VNNI, multiply a pass (where the CPU has both). A tile product
    costs about the same for 1-8 rows of any kind; VNNI's grows with every row, an exact row's (three byte products per
    weight) faster than a draft-only row's (one)."""

    exact: int
    """Passes of this many exact rows or more go to the tiles (0 or 1: every pass)."""
    drafted: int
    """A pass of one exact row and draft-only rows goes to the tiles from this many rows."""

    def weights(self) -> tuple[int, int]:
        """(the pass weight from which the tiles serve, a draft-only row's weight), an exact row weighing
        :data:`ROW_WEIGHT`: mixed passes (batches) are placed between the two measured kinds."""
        if self.exact <= 1:
            return 0, ROW_WEIGHT
        light = -(-ROW_WEIGHT * (self.exact - 1) // (self.drafted - 1)) if self.drafted > 1 else ROW_WEIGHT
        return ROW_WEIGHT * self.exact, light

    def __str__(self) -> str:
        return "every pass" if self.exact <= 1 else f"{self.exact} exact / {self.drafted} drafted rows"


TILES_EVERY_PASS = TileRows(0, 0)
"""The tiles serve every pass (before a measurement, or where VNNI is off)."""
TILES_NEVER = TileRows(1 << 20, 1 << 20)
"""A :func:`tiles_from` value that keeps every pass on VNNI (for A/B runs)."""


class Wide(enum.IntFlag):
    """Which kernel classes run their AVX-512 forms (the bits of ``avx512_forms`` in kernels/blockq.cpp)."""

    NONE = 0
    ROWS = 1
    """The row kernels (passes under :data:`LANE_ROWS` rows for their kind) and the multi-row attention loops of
    short passes."""
    LANES = 2
    """The lane kernels (passes of :data:`LANE_ROWS` rows or more for their kind)."""
    ALL = 3


_OFF_WORDS = frozenset({"0", "false", "no", "off"})
"""Values that switch an environment setting off (any other value of a switch leaves it on)."""
_PINNED_FORMS = {
    **dict.fromkeys(_OFF_WORDS, Wide.NONE),
    **dict.fromkeys(("1", "true", "yes", "on", "all"), Wide.ALL),
    "rows": Wide.ROWS,
    "lanes": Wide.LANES,
}


def pinned_forms() -> Wide | None:
    """The kernel forms :data:`AVX512_ENV` pins, or None where it is unset (then they are measured)."""
    raw = os.environ.get(AVX512_ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in _PINNED_FORMS:
        raise ConfigError(
            f"{AVX512_ENV}={raw!r} is not a kernel form: set it to 0 (AVX2 only), 1 (AVX-512 for both kernel "
            "classes), rows or lanes (AVX-512 for one class), or unset it to measure the faster forms."
        )
    return _PINNED_FORMS[raw]


_SOURCE = Path(__file__).with_name("kernels") / "blockq.cpp"
_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++20")


def _switched_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in _OFF_WORDS


def enabled() -> bool:
    return _switched_on(ENV_SWITCH)


def avx512_forms() -> Wide:
    """The kernel classes that run their AVX-512 forms in this process (none without the kernels or AVX-512)."""
    return Wide(int(torch.ops.agent_mtp_blockq.avx512_forms(-1))) if kernels_available() else Wide.NONE


def avx512_active() -> bool:
    """Whether any kernel class runs its AVX-512 form (the CPU has AVX-512 F/BW/DQ/VL/VBMI and :data:`AVX512_ENV`
    allows it)."""
    return bool(avx512_forms())


_settled: list[Wide] = []
_settle_lock = threading.Lock()


def settle_avx512(measure: Callable[[], Wide]) -> Wide:
    """Keep the faster form of each kernel class for this process: ``measure()`` (the classes whose AVX-512 form is
    faster) decides once, the first time a model large enough to time is prepared, unless :data:`AVX512_ENV` is set
    (then its choice stands). Returns the classes that run their AVX-512 forms."""
    with _settle_lock:
        if not _settled:
            if kernels_available() and pinned_forms() is None:
                torch.ops.agent_mtp_blockq.avx512_forms(int(measure()))
                log.info("Block kernels: AVX-512 forms for %s (the faster here)", forms_name(avx512_forms()))
            _settled.append(avx512_forms())
        return _settled[0]


_buffered_settled: list[int] = []


def settle_buffered_rows(measure: Callable[[], int]) -> int:
    """From how many rows AVX2 lane passes take the buffered path in this process: ``measure()`` decides once, the
    first time a model large enough to time is prepared (:data:`BUFFERED_ROWS` until then, and where the kernels are
    not loaded). Returns the threshold in force."""
    with _settle_lock:
        if not _buffered_settled:
            if kernels_available():
                rows = measure()
                torch.ops.agent_mtp_blockq.buffered_rows(rows)
                log.info(
                    "Block kernels: AVX2 lane passes of %d+ rows multiply buffered weights (the faster here)", rows
                )
            _buffered_settled.append(buffered_rows())
        return _buffered_settled[0]


def buffered_rows() -> int:
    """The row count from which AVX2 lane passes take the buffered path in this process (:data:`BUFFERED_ROWS`
    where the kernels are not loaded)."""
    return int(torch.ops.agent_mtp_blockq.buffered_rows(-1)) if kernels_available() else BUFFERED_ROWS


@contextlib.contextmanager
def buffered_from(rows: int) -> Iterator[int]:
    """Inside the block, AVX2 lane passes of ``rows`` rows or more take the buffered path (the same bits as the lane
    tiles), process-wide, for measurements and tests. Yields ``rows``."""
    if not kernels_available():
        raise ConfigError("The block-weight kernels are not loaded in this process; there is no lane pass to buffer.")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ConfigError(f"buffered_from(rows={rows!r}): give a whole number of rows >= 1, e.g. 5 or 9.")
    with _kernel_setting("buffered_rows", rows):
        yield rows


@contextlib.contextmanager
def _kernel_setting(op: str, value: int) -> Iterator[None]:
    """Set one of the kernels' process-wide integers (``torch.ops.agent_mtp_blockq.<op>``: -1 reads it, a value sets
    it) inside the block, restored afterwards."""
    setting = getattr(torch.ops.agent_mtp_blockq, op)
    before = int(setting(-1))
    setting(value)
    try:
        yield
    finally:
        setting(before)


def pinned_tile_rows() -> TileRows | None:
    """The pass sizes :data:`AMX_ROWS_ENV` pins, or None where it is unset (then they are measured)."""
    raw = os.environ.get(AMX_ROWS_ENV, "").strip()
    if not raw:
        return None
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(
            f"{AMX_ROWS_ENV}={raw!r} is not N or N,M (whole numbers of rows): set e.g. {AMX_ROWS_ENV}=8 (passes of 8 "
            "rows or more on the AMX tiles, shorter ones on VNNI), 8,24 (drafted passes from 24 rows), 0 (the tiles "
            "for every pass), or unset it to measure them."
        )
    exact, drafted = int(parts[0]), int(parts[-1])
    if exact <= 1:
        return TILES_EVERY_PASS
    if drafted < exact:
        raise ConfigError(
            f"{AMX_ROWS_ENV}={raw!r}: a drafted pass (M = {drafted}) cannot reach the tiles before an exact one "
            f"(N = {exact}): its draft-only rows cost VNNI less than exact rows. Set M >= N, e.g. "
            f"{AMX_ROWS_ENV}={exact},{max(exact, 4 * exact)}."
        )
    return TileRows(exact, drafted)


_tile_rows_chosen = [TILES_EVERY_PASS]
"""The process's choice (pinned or measured, :func:`settle_tile_rows`)."""
_tile_rows_override: list[TileRows] = []
"""What :func:`tiles_from` blocks set, innermost last; they win over the choice while they last."""


def tile_rows() -> TileRows:
    """From which pass sizes the AMX tiles serve a pass where VNNI could too, as the kernels stand."""
    kernels_available()  # loading them applies a pinned choice
    return _effective_tile_rows()


def _effective_tile_rows() -> TileRows:
    return _tile_rows_override[-1] if _tile_rows_override else _tile_rows_chosen[0]


def _apply_tile_rows() -> None:
    torch.ops.agent_mtp_blockq.tiles_from(*_effective_tile_rows().weights())


def _choose_tile_rows(rows: TileRows) -> None:
    _tile_rows_chosen[0] = rows
    _apply_tile_rows()


def records_path(rows: int, light: int = 0) -> str:
    """Which path multiplies a pass of ``rows`` rows (``light`` of them draft-only, on the 8-bit grid) for weights
    with a record layout, as the switches stand: "amx", "vnni" or "avx" (the AVX kernels)."""
    if not kernels_available():
        return "avx"
    return ("avx", "vnni", "amx")[int(torch.ops.agent_mtp_blockq.records_path(rows, light))]


@contextlib.contextmanager
def tiles_from(rows: TileRows) -> Iterator[None]:
    """Inside the block, the AMX tiles serve the passes ``rows`` gives them and VNNI the others (where both are on;
    :data:`TILES_NEVER`: VNNI every pass), process-wide, for benchmarks and tests; restored after."""
    if not kernels_available():
        raise ConfigError("The block-weight kernels are not loaded in this process; there are no AMX tiles to pick.")
    _tile_rows_override.append(rows)
    _apply_tile_rows()
    try:
        yield
    finally:
        _tile_rows_override.pop()  # a choice settled inside the block applies from here on
        _apply_tile_rows()


_tiles_settled: list[TileRows] = []


def settle_tile_rows(measure: Callable[[], TileRows]) -> TileRows:
    """Where the tiles and VNNI are both on: ``measure()`` (the pass sizes from which the tiles are the faster,
    :func:`agent_mtp.engine.fast.weights.measure_tile_rows`) decides once per process, the first time a model large
    enough to time is prepared, unless :data:`AMX_ROWS_ENV` pins them (a measurement inside a :func:`tiles_from` block
    serves once the block ends). Returns the process's choice."""
    with _settle_lock:
        if not _tiles_settled:
            if pinned_tile_rows() is None and tiles_active() and torch.ops.agent_mtp_blockq.vnni_records(-1):
                rows = measure()
                _choose_tile_rows(rows)
                log.info("Block passes on AMX tiles from %s, shorter ones on VNNI (measured)", rows)
            _tiles_settled.append(_tile_rows_chosen[0])
        return _tiles_settled[0]


def forms_name(forms: Wide) -> str:
    """The kernel classes ``forms`` names, in words (logs, `agent-mtp measure-machine`)."""
    return {Wide.NONE: "no class", Wide.ROWS: "the row kernels", Wide.LANES: "the lane kernels"}.get(
        forms, "both kernel classes"
    )


@contextlib.contextmanager
def avx512(enable: bool | Wide) -> Iterator[bool]:
    """Run the kernels in their AVX-512 (``True``: both classes, or the classes of a :class:`Wide`, where the CPU has
    it) or AVX2 forms inside the block, process-wide, for benchmarks and tests that compare them side by side. Yields
    whether the requested AVX-512 forms are in use."""
    if not kernels_available():
        raise ConfigError("The block-weight kernels are not loaded in this process; there is no AVX-512 form to pick.")
    wanted = enable if isinstance(enable, Wide) else (Wide.ALL if enable else Wide.NONE)
    switch = torch.ops.agent_mtp_blockq.avx512_forms
    before = int(switch(-1))
    try:
        yield int(switch(int(wanted))) == int(wanted) and bool(wanted)
    finally:
        switch(before)


def tiles_wanted() -> bool:
    """Whether weights get the tile records' layout: the kernels are loaded and the CPU has AMX-INT8 (or AVX-512 VNNI)
    that :data:`AMX_ENV` (:data:`VNNI_ENV`) does not switch off."""
    if not kernels_available():
        return False
    ops = torch.ops.agent_mtp_blockq
    return (_switched_on(AMX_ENV) and bool(ops.amx_supported())) or (
        _switched_on(VNNI_ENV) and bool(ops.vnni_supported())
    )


def tiles_active() -> bool:
    """Whether block passes with a tile layout multiply on AMX tiles in this process right now."""
    return kernels_available() and bool(torch.ops.agent_mtp_blockq.amx_tiles(-1))


def vnni_active() -> bool:
    """Whether every block pass with a tile layout multiplies on AVX-512 VNNI in this process right now (where AMX
    tiles are active, VNNI serves only the short passes: :func:`records_path`)."""
    return kernels_available() and bool(torch.ops.agent_mtp_blockq.vnni_records(-1)) and not tiles_active()


def records_active() -> bool:
    """Whether block passes read the tile records (on AMX or VNNI) rather than the AVX kernels' layouts."""
    return tiles_active() or vnni_active()


SCREEN_ENV = "AGENT_MTP_SCREEN_HEAD"
"""Set to 0 to compute every greedy row of the output head exactly instead of screening it on the 8-bit grid
(:meth:`BlockWeights.screened`; the same argmax either way)."""


@functools.cache
def _vnni_supported() -> bool:
    return kernels_available() and bool(torch.ops.agent_mtp_blockq.vnni_supported())


def screen_enabled() -> bool:
    """Whether greedy rows of the output head may be screened (:data:`SCREEN_ENV` not 0)."""
    return _switched_on(SCREEN_ENV)


@contextlib.contextmanager
def _switched(op: str, enable: bool, missing: str) -> Iterator[bool]:
    """Set the kernels' on/off switch ``op`` (-1 reads it) to ``enable`` inside the block, process-wide, and back
    after; yields whether it is on (only where the CPU has the path)."""
    if not kernels_available():
        raise ConfigError(f"The block-weight kernels are not loaded in this process; there {missing} to pick.")
    switch = getattr(torch.ops.agent_mtp_blockq, op)
    before = bool(switch(-1))
    try:
        yield bool(switch(int(enable)))
    finally:
        switch(int(before))


def vnni(enable: bool) -> contextlib.AbstractContextManager[bool]:
    """Multiply block passes on AVX-512 VNNI (where the weights have records and the CPU has it) or with the AVX
    kernels inside the block, process-wide, for benchmarks and tests that compare them. Yields whether it is on."""
    return _switched("vnni_records", enable, "is no VNNI path")


def attention_prefetch(spread: bool) -> contextlib.AbstractContextManager[bool]:
    """Inside the block, attention's loops ask for the next chunk of 64 keys (or values) a few cache lines per
    block of 8 keys (``spread``, the default) or all of it before the chunk's first score (as before 2026-12-07),
    process-wide, for measurements and tests: the same numbers either way (``attention_prefetch`` in
    kernels/blockq.cpp, whose form 2 keeps the burst in the AVX-512 pair loops only). Yields ``spread``."""
    return _switched("attention_prefetch", spread, "is no attention kernel")


@contextlib.contextmanager
def avx_kernels() -> Iterator[None]:
    """The AVX kernels for every pass (AMX tiles and VNNI off) inside the block."""
    with amx(False), vnni(False):
        yield


@contextlib.contextmanager
def vnni_tail(rows: int) -> Iterator[int]:
    """Inside the block, an exact tile pass's last partial chunk of at most ``rows`` rows (0-8; 0: none) is multiplied
    on VNNI beside the tiles' full chunks of 8, where both paths are on (the same bits; the kernels' default is
    :data:`VNNI_TAIL_ROWS`), process-wide, for benchmarks and tests. Yields ``rows``."""
    if not kernels_available():
        raise ConfigError("The block-weight kernels are not loaded in this process; there is no tile pass to split.")
    if not 0 <= rows <= 8:
        raise ConfigError(f"vnni_tail(rows={rows!r}): give 0 (the tiles take every row) to 8 rows.")
    with _kernel_setting("tail_rows", rows):
        yield rows


def amx(enable: bool) -> contextlib.AbstractContextManager[bool]:
    """Multiply on AMX tiles (where the weights have a tile layout and the CPU has AMX-INT8) or with the AVX kernels
    inside the block, process-wide, for benchmarks and tests that compare them. Yields whether tiles are in use."""
    return _switched("amx_tiles", enable, "are no AMX tiles")


@functools.cache
def kernels_available() -> bool:
    """Whether the block kernels are loaded in this process (compiled into the cache directory on first use)."""
    reason = _unsupported_reason()
    if reason is None:
        try:
            torch.ops.load_library(str(_compiled_library()))
            pinned = pinned_forms()
            torch.ops.agent_mtp_blockq.avx512_forms(int(Wide.ALL if pinned is None else pinned))
            torch.ops.agent_mtp_blockq.amx_tiles(int(_switched_on(AMX_ENV)))
            torch.ops.agent_mtp_blockq.vnni_records(int(_switched_on(VNNI_ENV)))
            torch.ops.agent_mtp_blockq.tail_rows(VNNI_TAIL_ROWS)
            _tile_rows_chosen[0] = pinned_tile_rows() or TILES_EVERY_PASS
            _apply_tile_rows()
            return True
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            reason = f"building or loading them failed: {str(e).strip()[:500]}"
    log.warning("The fast runtime reads float32 weights only: block-weight kernels unavailable (%s).", reason)
    return False


def kernel_tag() -> str:
    """A short name of the weight path passes take (part of the cost curve's cache key)."""
    if not (enabled() and kernels_available()):
        return "fp32"
    if tiles_active():
        rows = tile_rows() if torch.ops.agent_mtp_blockq.vnni_records(-1) else TILES_EVERY_PASS
        return "blockq8-amx" if rows == TILES_EVERY_PASS else f"blockq8-vnni3-amx{rows.exact}-{rows.drafted}"
    # 8: draft-only masks on the 8-bit grid (7: Q8_0 lanes from 2 rows, row kernels prefetch); vnni2: the VNNI
    # streams scale each row's sums in registers and read Q4_1's a0 bytes inside the products (faster passes); vnni3:
    # their rows unrolled, each sum in two registers; 9: the AVX2 lane kernels rebuild a position's weights one
    # position ahead (cheaper passes of 5+ rows); 10: their tiles of 2-5 rows take 2-4 groups at once (the output
    # head of 2-4-row passes ~1.3-1.5x faster); 11: AVX2 passes of 16+ rows multiply weights rebuilt once per task;
    # 12: from 9 rows (a tie on Zen 3, 0.75x the time at 10-12 rows on Zen 1); 13: attention's AVX2 loops ask for
    # the next chunk of keys / values as they go (0.82-0.92x the attention time on Zen 3); vnni4: VNNI passes of
    # 9-16 rows in one chunk (two of 8 before), longer ones in equal chunks
    forms = avx512_forms()
    tag = {Wide.NONE: "blockq14", Wide.ALL: "blockq14-avx512"}.get(
        forms, f"blockq14-avx512{(forms.name or '').lower()}"
    )
    if not forms & Wide.LANES and buffered_rows() != BUFFERED_ROWS:  # AVX2 lane passes buffered from fewer rows
        tag += f"-b{buffered_rows()}"
    return f"{tag}-vnni4" if vnni_active() else tag


def pinned_rows() -> int | None:
    """The crossover pinned by :data:`ROWS_ENV`, or None where it is unset (then it is measured)."""
    raw = os.environ.get(ROWS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"{ROWS_ENV}={raw!r} is not a whole number of rows; set e.g. {ROWS_ENV}=8, or unset it.")
    return int(raw)


def _unsupported_reason() -> str | None:
    if platform.system() != "Linux" or platform.machine().lower() not in {"x86_64", "amd64"}:
        return f"they are built for Linux x86-64, this is {platform.system()} {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in {"AVX2", "AVX512"}:
        return f"they need AVX2 and FMA; torch reports CPU capability {capability}"
    if _compiler() is None:
        return "no C++ compiler (set CXX, or install g++)"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def build_key() -> str:
    """The loaded kernels' build key (a hash of their source, torch, the compiler and its flags); "" where they are
    not loaded."""
    return _compiled_library().stem.removeprefix("blockq-") if kernels_available() else ""


def _compiled_library() -> Path:
    from torch.utils import cpp_extension

    from agent_mtp.engine.loading import cache_root

    compiler = _compiler()
    assert compiler is not None
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libraries = [f"-L{path}" for path in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    key = hashlib.sha256(
        b"\0".join(s.encode() for s in (_SOURCE.read_text(), torch.__version__, compiler, abi, *_FLAGS))
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"blockq-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("Compiling the block-weight kernels into %s (one time, a few seconds)", target.parent)
    fd, staging = tempfile.mkstemp(prefix=".blockq-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        command = [compiler, *_FLAGS, abi, *includes, str(_SOURCE), "-o", staging, *libraries]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} exited {done.returncode}: {done.stderr[-1500:]}")
        os.replace(staging, target)  # atomic: concurrent processes (replicas) never load a half-written file
    finally:
        Path(staging).unlink(missing_ok=True)
    return target


def _fp16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _kernels_loaded() -> bool:
    """Whether :func:`kernels_available` has been asked and loaded the kernels (without compiling them here)."""
    return kernels_available.cache_info().currsize > 0 and kernels_available()


def _q4_1_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recover (q, d, m) from [rows, n, 32] float32 values; ``ok`` [rows] marks rows rebuilt bit for bit. Once the
    kernels are loaded, one C++ pass computes the same (``recover_q4_1``; ~11 full passes of torch ops otherwise,
    1.2 s for the default model on a 2-core Zen 1)."""
    if _kernels_loaded() and blocks.is_contiguous():
        q, d, m, ok = torch.ops.agent_mtp_blockq.recover_q4_1(blocks)
        return q, d, m, ok
    return _q4_1_blocks_reference(blocks)


def _q4_1_blocks_reference(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_q4_1_blocks` in torch ops (before the kernels are loaded, and the tests' reference)."""
    low = blocks.amin(-1)
    scale = _fp16_exact((blocks.amax(-1) - low) / 15)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = torch.where(scale[..., None] > 0, torch.round((blocks - low[..., None]) / safe), 0.0).clamp_(0, 15)
    rebuilt = q * scale[..., None] + low[..., None]  # q * d is exact, so this rounds once, as the kernel's fma
    ok = (rebuilt == blocks).flatten(1).all(-1) & (_fp16_exact(low) == low).all(-1)
    return q.to(torch.uint8), scale, low, ok


def _q8_0_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recover (q, d) from [rows, n, 32] float32 values as Q8_0; ``ok`` [rows] marks rows rebuilt bit for bit (one C++
    pass once the kernels are loaded, as :func:`_q4_1_blocks`)."""
    if _kernels_loaded() and blocks.is_contiguous():
        q, d, ok = torch.ops.agent_mtp_blockq.recover_q8_0(blocks)
        return q, d, ok
    return _q8_0_blocks_reference(blocks)


def _q8_0_blocks_reference(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_q8_0_blocks` in torch ops."""
    scale = _fp16_exact(blocks.abs().amax(-1) / 127)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    q = torch.where(scale[..., None] > 0, torch.round(blocks / safe), 0.0).clamp_(-128, 127)
    ok = (q * scale[..., None] == blocks).flatten(1).all(-1)
    return q.to(torch.int8), scale, ok


def _q4_1_lanes(q4: torch.Tensor) -> torch.Tensor:
    """Nibbles [rows, blocks, 32] (rows a multiple of 8) -> the lane kernels' layout [rows / 8, blocks * 128] uint8:
    per group, block and position one little-endian 32-bit word whose byte j holds features 2j (low nibble) and
    2j + 1 (high nibble)."""
    rows, blocks, _ = q4.shape
    by_group = q4.reshape(rows // GROUP, GROUP // 2, 2, blocks, BLOCK)  # [groups, byte j, low/high, blocks, i]
    words = by_group[:, :, 0] | (by_group[:, :, 1] << 4)  # [groups, 4, blocks, 32]
    return words.permute(0, 2, 3, 1).contiguous().reshape(rows // GROUP, -1)


def _q8_0_lanes(q8: torch.Tensor) -> torch.Tensor:
    """Quants [rows, blocks, 32] int8 -> the lane kernels' layout [rows / 8, blocks * 256] uint8: per group, block and
    position the 8 features' bytes."""
    rows, blocks, _ = q8.shape
    by_group = q8.view(torch.uint8).reshape(rows // GROUP, GROUP, blocks, BLOCK)
    return by_group.permute(0, 2, 3, 1).contiguous().reshape(rows // GROUP, -1)


TILE_FEATURES = 16
"""Output features per AMX tile record (``tiles::kFeatures`` in kernels/blockq.cpp)."""


def _by_records(t: torch.Tensor) -> torch.Tensor:
    """[out, blocks, ...] -> [ceil(out / 16), blocks, 16, ...], the last record padded with zero features."""
    out = int(t.shape[0])
    padded = -(-out // TILE_FEATURES) * TILE_FEATURES
    if padded != out:
        t = torch.cat([t, t.new_zeros(padded - out, *t.shape[1:])])
    return t.reshape(padded // TILE_FEATURES, TILE_FEATURES, *t.shape[1:]).transpose(1, 2)


def _tile_order(q: torch.Tensor) -> torch.Tensor:
    """Quants [out, blocks, 32] -> [records, blocks, 8, 64]: per record and block the B tile of a 32-deep block, tile
    row kk holding, for each of the 16 features, its inputs 4kk..4kk+3."""
    by_record = _by_records(q)  # [records, blocks, 16, 32]
    records, blocks = int(by_record.shape[0]), int(by_record.shape[1])
    words = by_record.reshape(records, blocks, TILE_FEATURES, 8, 4)  # [.., feature, kk, 4 inputs]
    return words.permute(0, 1, 3, 2, 4).reshape(records, blocks, 8, 64)


def _as_bytes(t: torch.Tensor, records: int, blocks: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[out, blocks] -> per record and block the 16 features' values in ``dtype``, as bytes (float16 holds a block
    row's scales exactly: they are GGUF float16 numbers; an exception row's are not, and its outputs are recomputed
    in float32)."""
    values = _by_records(t[..., None]).reshape(records, blocks, TILE_FEATURES)
    return values.to(dtype).contiguous().view(torch.uint8)


def _q4_1_tiles(q4: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Q4_1 as tile records [records, blocks * 320] uint8: per record and block 256 bytes of quants (B-tile rows 2c
    and 2c + 1 in the low and high nibbles of bytes 64c..64c + 63), then d and m of the 16 features in float16."""
    rows = _tile_order(q4)  # [records, blocks, 8, 64]
    records, blocks = int(rows.shape[0]), int(rows.shape[1])
    nibbles = rows[:, :, 0::2] | (rows[:, :, 1::2] << 4)  # [records, blocks, 4, 64]
    half = torch.float16
    parts = [nibbles.reshape(records, blocks, 256), _as_bytes(scale, records, blocks, half)]
    parts.append(_as_bytes(low, records, blocks, half))
    return torch.cat(parts, -1).reshape(records, -1).contiguous()


def _q8_0_tiles(q8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Q8_0 as tile records [records, blocks * 576] uint8: per record and block the 8 B-tile rows (512 bytes), then
    d of the 16 features."""
    rows = _tile_order(q8.view(torch.uint8))
    records, blocks = int(rows.shape[0]), int(rows.shape[1])
    parts = [rows.reshape(records, blocks, 512), _as_bytes(scale, records, blocks)]
    return torch.cat(parts, -1).reshape(records, -1).contiguous()


def _grouped(t: torch.Tensor) -> torch.Tensor:
    """[rows, blocks, per_block] -> the kernels' layout [rows / 8, blocks, 8, per_block], flattened to [rows, -1]."""
    rows, blocks, per_block = t.shape
    return t.reshape(rows // GROUP, GROUP, blocks, per_block).transpose(1, 2).contiguous().reshape(rows, -1)


Norm = tuple[torch.Tensor, float]
"""An RMS norm applied to a GEMM's input: (weight [in], eps)."""


@dataclass(frozen=True)
class BlockWeights:
    """A weight [out, in] held as quantization blocks in the kernels' layout, plus the few float32 rows that are
    not block-structured (computed with ``F.linear`` and written over the kernel's output)."""

    kind: str
    """``"q4_1"`` or ``"q8_0"``."""
    out_features: int
    qs: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    exception_rows: torch.Tensor | None
    exception_weight: torch.Tensor | None
    lanes: torch.Tensor | None = None
    """The quants again, feature-interleaved for the lane kernels that passes of :data:`LANE_ROWS` rows or more (per
    kind) take: per group of 8 features, block and position, one 32-bit word (Q4_1: feature f in bits 4f..4f+3) or
    8 bytes (Q8_0)."""
    tiles: torch.Tensor | None = None
    """The blocks again as AMX tile records (:func:`_q4_1_tiles`, :func:`_q8_0_tiles`), which every pass multiplies
    where the CPU has AMX-INT8 (:func:`tiles_active`), or with AVX-512 VNNI where it has that instead
    (:func:`vnni_active`); None where it has neither."""
    screen_bounds: torch.Tensor | None = None
    """Q8_0 with tile records: ``|d| sum |q|`` per output and block [out, in / 32] float32, rounded up, which bounds
    how far an output computed on the 8-bit input grid can be from its exact value (:meth:`screened`); else None."""
    screen_peaks: torch.Tensor | None = None
    """The largest of :attr:`screen_bounds` per block [in / 32] (over the block-structured outputs)."""

    @property
    def nbytes(self) -> int:
        """Bytes a one-row pass reads (the lane layout serves longer passes instead of ``qs``; on AMX or VNNI the
        tile records serve every pass)."""
        if self.tiles is not None and records_active():
            return self.tiles.numel() + (self.exception_weight.numel() * 4 if self.exception_weight is not None else 0)
        parts = [self.qs, self.scale, self.minimum, self.exception_weight]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)

    @property
    def accumulates(self) -> bool:
        """Whether :meth:`add_into` can add into a residual in place (no padding, no float32 exception rows)."""
        return int(self.qs.shape[0]) == self.out_features and self.exception_rows is None

    def add_into(
        self,
        residual: torch.Tensor,
        x: torch.Tensor,
        extra: torch.Tensor | None = None,
        coarse: Sequence[int] = (),
        *,
        grid_bits: int = 24,
    ) -> torch.Tensor:
        """``residual += x W^T`` in place, in the kernel (one op instead of a product and an add); returns the
        ``extra`` rows' products [n, r] ([n, 0] without). Needs :attr:`accumulates`. ``coarse``, ``grid_bits``: see
        :meth:`__call__`."""
        x = x.contiguous()
        layouts = {"lanes": self.lanes, "tiles": self.tiles, "coarse_runs": list(coarse), "grid_bits": grid_bits}
        if self.kind == "q4_1":
            assert self.minimum is not None
            return torch.ops.agent_mtp_blockq.q4_1_linear(  # type: ignore[no-any-return]
                x, self.qs, self.scale, self.minimum, extra, residual, **layouts
            )
        return torch.ops.agent_mtp_blockq.q8_0_linear(  # type: ignore[no-any-return]
            x, self.qs, self.scale, extra, residual, **layouts
        )

    def __call__(
        self,
        x: torch.Tensor,
        extra: torch.Tensor | None = None,
        norm: Norm | None = None,
        coarse: Sequence[int] = (),
        *,
        grid_bits: int = 24,
    ) -> torch.Tensor:
        """x [n, in] float32 -> [n, out + r] float32, where ``extra`` [r, in] are float32 rows computed in the same
        call after the block rows (an adapter's low-rank factor rides along at no extra op); with ``norm`` (weight,
        eps) the rows multiplied are ``rms_norm(x) * weight``, normalised in the same call. ``coarse``: rows (as
        flattened [start, stop) runs) whose inputs the record paths (AMX, VNNI) put on an 8-bit grid per block
        instead of the 24-bit one (one integer product per weight instead of three; ~1e-2 of the largest output
        off): rows whose products are only drafts (mask rows in ``verified``). ``grid_bits``: the other rows' grid
        on the record paths: 24 (float32-accurate; the default) or 16 (each block's inputs at 2^-15 of its largest
        |x|, ~1e-5 of an output off; VNNI then makes 16 integer products per weight block and exact row instead of
        24: :data:`GRID_BITS`). Both ignored by the AVX kernels, which compute every row in float32."""
        x = x.contiguous()
        weight, eps = norm if norm is not None else (None, 1e-5)
        extra, exceptions, count = self._with_exception_rows(extra)
        if self.kind == "q4_1":
            assert self.minimum is not None
            y = torch.ops.agent_mtp_blockq.q4_1_linear(
                x,
                self.qs,
                self.scale,
                self.minimum,
                extra,
                None,
                weight,
                eps,
                self.lanes,
                self.tiles,
                list(coarse),
                grid_bits,
            )
        else:
            y = torch.ops.agent_mtp_blockq.q8_0_linear(
                x, self.qs, self.scale, extra, None, weight, eps, self.lanes, self.tiles, list(coarse), grid_bits
            )
        return self._placed(y, exceptions, count)

    @property
    def screens(self) -> bool:
        """Whether :meth:`screened` screens rows here: Q8_0 with tile records multiplied on AVX-512 VNNI
        (:func:`vnni_active`), else it computes them exactly. On AMX tiles an exact chunk of up to 8 rows costs about
        what a coarse one does, and the screen was never measured there, so the tiles keep every row exact."""
        return self.screen_bounds is not None and vnni_active() and _vnni_supported()

    def screened(
        self,
        x: torch.Tensor,
        screen: Sequence[int],
        extra: torch.Tensor | None = None,
        norm: Norm | None = None,
        coarse: Sequence[int] = (),
        *,
        grid_bits: int = 24,
    ) -> tuple[torch.Tensor, int]:
        """:meth:`__call__` whose rows in ``screen`` (flattened [start, stop) runs: greedy rows, read only for their
        argmax) are multiplied on the 8-bit input grid, as ``coarse`` rows are, and then every output that could be
        their argmax is recomputed exactly, from a rigorous bound on the 8-bit grid's error (``q8_0_screened`` in
        kernels/blockq.cpp). Each screened row's argmax (its first maximum) is the exact product's, bit for bit; its
        other outputs are approximations below that maximum. Returns (y, record streams of 16 outputs recomputed).
        Exact rows everywhere where :attr:`screens` is False."""
        if not (self.screens and screen):
            return self(x, extra, norm, coarse, grid_bits=grid_bits), 0
        assert self.screen_bounds is not None and self.screen_peaks is not None
        x = x.contiguous()
        weight, eps = norm if norm is not None else (None, 1e-5)
        extra, exceptions, count = self._with_exception_rows(extra)
        excluded = self.exception_rows.tolist() if self.exception_rows is not None else []
        layouts = {"lanes": self.lanes, "tiles": self.tiles, "coarse_runs": list(coarse), "grid_bits": grid_bits}
        bounds = {"bounds": self.screen_bounds, "peak_bounds": self.screen_peaks, "excluded": excluded}
        y, recomputed = torch.ops.agent_mtp_blockq.q8_0_screened(
            x,
            self.qs,
            self.scale,
            extra,
            weight,
            eps,
            valid=self.out_features,
            screen_runs=list(screen),
            **layouts,
            **bounds,
        )
        return self._placed(y, exceptions, count), int(recomputed)

    def _with_exception_rows(self, extra: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """(the kernel's extra rows, the float32 exception rows, their count): the exception rows ride first with
        the extra rows, computed in the kernel one fixed chain per row (an F.linear GEMM's numbers would depend on
        how many rows the pass has)."""
        exceptions = self.exception_weight if self.exception_rows is not None else None
        if exceptions is None:
            return extra, None, 0
        return (exceptions if extra is None else torch.cat([exceptions, extra])), exceptions, int(exceptions.shape[0])

    def _placed(self, y: torch.Tensor, exceptions: torch.Tensor | None, count: int) -> torch.Tensor:
        """The kernel's output [n, padded + exception rows + extra rows] as [n, out + extra rows]: the float32
        exception rows' products written over the block rows' there."""
        padded = int(self.qs.shape[0])
        if padded == self.out_features and count == 0:
            return y  # type: ignore[no-any-return]
        block = y[:, : self.out_features]
        if exceptions is not None:
            block[:, self.exception_rows] = y[:, padded : padded + count]
        tail = y[:, padded + count :]
        return block if tail.shape[1] == 0 else torch.cat([block, tail], 1)


def block_weights(weight: torch.Tensor) -> BlockWeights | None:
    """``weight`` as Q4_1 or Q8_0 blocks if its float32 values are exactly such blocks (all but at most 1% of its
    rows), else None. Needs the kernels (see :func:`kernels_available`)."""
    if not (enabled() and weight.dtype == torch.float32 and weight.dim() == 2 and weight.shape[1] % BLOCK == 0):
        return None
    found = _recover_blocks(weight)
    return found if found is not None and kernels_available() else None  # compile only for weights that are blocks


def _recover_blocks(weight: torch.Tensor) -> BlockWeights | None:
    out_features, in_features = int(weight.shape[0]), int(weight.shape[1])
    padded = -(-out_features // GROUP) * GROUP
    dense = weight.detach().contiguous()
    if padded != out_features:
        dense = torch.cat([dense, dense.new_zeros(padded - out_features, in_features)])
    blocks = dense.view(padded, in_features // BLOCK, BLOCK)
    limit = max(1, int(out_features * MAX_EXCEPTION_SHARE))
    q4, scale, low, ok = _q4_1_blocks(blocks)
    if int((~ok).sum()) <= limit:
        packed = (q4[..., :16] | (q4[..., 16:] << 4)).contiguous()
        found = _with_exceptions("q4_1", weight, packed, scale, low, ok, out_features)
        tiles = _q4_1_tiles(q4[:out_features], scale[:out_features], low[:out_features]) if tiles_wanted() else None
        return dataclasses.replace(found, lanes=_q4_1_lanes(q4), tiles=tiles)
    q8, scale8, ok8 = _q8_0_blocks(blocks)
    if int((~ok8).sum()) <= limit:
        found = _with_exceptions("q8_0", weight, q8.view(torch.uint8), scale8, None, ok8, out_features)
        tiles = _q8_0_tiles(q8[:out_features], scale8[:out_features]) if tiles_wanted() else None
        bounds, peaks = _screen_bounds(q8, scale8, ok8, out_features) if tiles is not None else (None, None)
        return dataclasses.replace(found, lanes=_q8_0_lanes(q8), tiles=tiles, screen_bounds=bounds, screen_peaks=peaks)
    return None


def _screen_bounds(
    q8: torch.Tensor, scale: torch.Tensor, ok: torch.Tensor, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(:attr:`BlockWeights.screen_bounds`, :attr:`BlockWeights.screen_peaks`) of Q8_0 quants [rows, blocks, 32] and
    scales [rows, blocks]: ``|d| sum |q|`` per output and block, summed in float64 (exact: integers times a float16
    value) and rounded up to float32; the peaks over the block-structured outputs (exception rows are excluded
    from screening by the kernel's caller)."""
    exact = scale[:out_features].double().abs() * q8[:out_features].double().abs().sum(-1)
    bounds = exact.float()
    bounds = torch.where(bounds.double() < exact, torch.nextafter(bounds, torch.full_like(bounds, torch.inf)), bounds)
    kept = ok[:out_features].all(-1) if ok.dim() > 1 else ok[:out_features]
    peaks = bounds[kept].amax(0) if bool(kept.any()) else bounds.new_zeros(bounds.shape[1])
    return bounds.contiguous(), peaks.contiguous()


def _with_exceptions(
    kind: str,
    weight: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    low: torch.Tensor | None,
    ok: torch.Tensor,
    out_features: int,
) -> BlockWeights:
    bad = (~ok[:out_features]).nonzero().flatten()
    return BlockWeights(
        kind=kind,
        out_features=out_features,
        qs=_grouped(packed),
        scale=_grouped(scale[..., None]).reshape(-1),
        minimum=_grouped(low[..., None]).reshape(-1) if low is not None else None,
        exception_rows=bad if bad.numel() else None,
        exception_weight=weight.detach()[bad].float().contiguous() if bad.numel() else None,
    )
