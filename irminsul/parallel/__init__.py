"""One engine over several GPUs, one process each (issue #22): the model split across the ranks
(:mod:`.shard`), the process group and its failure handling (:mod:`.group`), and the leader that
drives the followers' model runners (:mod:`.follow`). docs/multi-gpu.md describes the design."""

from .group import ParallelGroup, RankFailure, all_reduce, broadcast, guarded, init, shutdown
from .shard import shard_model, shard_weights

__all__ = ["ParallelGroup", "RankFailure", "all_reduce", "broadcast", "guarded", "init",
           "shard_model", "shard_weights", "shutdown"]
