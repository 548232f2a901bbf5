"""The MTP engine: model loading, mask token, gated adapters, the decode loop, acceptance rules, stats.

Knows nothing of LangChain, Redis, YAML or policies.
"""

from agent_mtp.engine.adapter import AdapterConfig, MTPAdapter, load_adapter, new_adapter
from agent_mtp.engine.config import DecodeConfig
from agent_mtp.engine.constraints import TokenConstraint
from agent_mtp.engine.cost import CostCurve
from agent_mtp.engine.engine import MTPEngine
from agent_mtp.engine.results import DecodeStats, GenerationResult, StreamChunk

__all__ = [
    "AdapterConfig",
    "CostCurve",
    "DecodeConfig",
    "DecodeStats",
    "GenerationResult",
    "MTPAdapter",
    "MTPEngine",
    "StreamChunk",
    "TokenConstraint",
    "load_adapter",
    "new_adapter",
]
