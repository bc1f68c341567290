"""The serving engine: the cache manager and the model runner over the split KV pool, the
synchronous :class:`Engine` over both, and the :class:`Scheduler` that batches requests."""

from ..config import MODES, EngineConfig, Mode
from .cache_manager import CacheManager
from .engine import Engine
from .kv_pool import KVPool, PoolExhausted
from .model_runner import ModelRunner
from .sampler import SamplingParams, sample
from .scheduler import Limits, Load, PromptTooLong, Request, Scheduler, StepOutput
from .sequence import Prefill, Sequence, ServeStats

__all__ = ["MODES", "CacheManager", "Engine", "EngineConfig", "KVPool", "Limits", "Load", "Mode",
           "ModelRunner", "PoolExhausted", "Prefill", "PromptTooLong", "Request", "SamplingParams",
           "Scheduler", "Sequence", "ServeStats", "StepOutput", "sample"]
