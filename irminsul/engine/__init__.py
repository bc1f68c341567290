"""The serving engine: the split KV pool and the serve path with live PIC."""

from .engine import MODES, Engine, Mode, Sequence, ServeStats
from .kv_pool import KVPool, PoolExhausted
from .scheduler import Request, SamplingParams, Scheduler, StepOutput

__all__ = ["MODES", "Engine", "KVPool", "Mode", "PoolExhausted", "Request", "SamplingParams",
           "Scheduler", "Sequence", "ServeStats", "StepOutput"]
