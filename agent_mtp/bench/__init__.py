"""Speed and quality benchmarks (``agent-mtp bench``) and policy A/B runs (``agent-mtp ab``).

Variants run side by side in one process, interleaved to cancel drift; quality is scored separately from speed.
See docs/benchmarks.md for the method and the results on the project machine.
"""

from agent_mtp.bench.core import (
    DEFAULT_VARIANTS,
    QUICK_VARIANTS,
    BenchPrompt,
    BenchReport,
    Run,
    Variant,
    VariantSummary,
    default_variants,
    load_suite,
    run_bench,
    run_once,
    variant_from_name,
    variants_from_names,
)

__all__ = [
    "DEFAULT_VARIANTS",
    "QUICK_VARIANTS",
    "BenchPrompt",
    "BenchReport",
    "Run",
    "Variant",
    "VariantSummary",
    "default_variants",
    "load_suite",
    "run_bench",
    "run_once",
    "variant_from_name",
    "variants_from_names",
]
