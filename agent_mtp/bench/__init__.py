"""Speed and quality benchmarks: variants run side by side in one process, interleaved to cancel drift."""

from agent_mtp.bench.core import BenchPrompt, BenchReport, Variant, default_variants, load_suite, run_bench

__all__ = ["BenchPrompt", "BenchReport", "Variant", "default_variants", "load_suite", "run_bench"]
