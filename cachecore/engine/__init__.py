"""Simulated vLLM-v1 engine: block pool with prefix caching, FCFS scheduler with chunked
prefill and preemption, step-time model. Clock-agnostic (see :mod:`cachecore.engine.core`)."""

from cachecore.engine.block_pool import BlockPool, CachedBlockInfo, KVBlock, NoFreeBlocksError
from cachecore.engine.core import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_MODEL_LEN,
    DEFAULT_NUM_BLOCKS,
    EngineConfig,
    EngineCore,
    EngineStats,
    StepResult,
    default_output_vocab,
)
from cachecore.engine.hashing import EngineHasher, HashAlgo, WireHashFormat
from cachecore.engine.latency import PROFILES, LatencyProfile, get_profile
from cachecore.engine.request import (
    DEFAULT_MAX_TOKENS,
    EngineRequest,
    FinishReason,
    RequestOutput,
    RequestRejectedError,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_MODEL_LEN",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_NUM_BLOCKS",
    "PROFILES",
    "BlockPool",
    "CachedBlockInfo",
    "EngineConfig",
    "EngineCore",
    "EngineHasher",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "HashAlgo",
    "KVBlock",
    "LatencyProfile",
    "NoFreeBlocksError",
    "RequestOutput",
    "RequestRejectedError",
    "StepResult",
    "WireHashFormat",
    "default_output_vocab",
    "get_profile",
]
