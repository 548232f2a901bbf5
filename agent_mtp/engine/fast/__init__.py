"""The fast CPU runtime: a small Llama-family forward that owns its memory.

The Hugging Face forward stays the reference (:class:`agent_mtp.engine.runner.CachedRunner`); this package is a
separate fast path checked against it (``tests/unit/test_fast_runtime.py``):

* weights prepared once per process (:mod:`.weights`): q/k/v and gate/up fused into one GEMM each, pre-packed for
  oneDNN, the q/k rows of every head reordered so RoPE is one complex multiply, the gated adapter's low-rank deltas
  fused per GEMM and applied to mask rows only;
* a preallocated KV cache written by position and rolled back by length (:mod:`.cache`);
* a forward with a handful of ops per layer that computes logits only for the rows the decoder reads
  (:mod:`.model`), behind the engine's ``Runner`` protocol (:mod:`.runner`).
"""

from agent_mtp.engine.fast.model import BatchItem, FastModel, unsupported_reason
from agent_mtp.engine.fast.runner import FastRunner

__all__ = ["BatchItem", "FastModel", "FastRunner", "unsupported_reason"]
