"""One engine over several GPUs, one process each (issue #22): the model split across the ranks
(:mod:`.shard`; :mod:`.load` reads a rank's share straight from a checkpoint), the process
group and its failure handling (:mod:`.group`), and the leader that drives the followers' model
runners (:mod:`.leader`). docs/multi-gpu.md describes the design."""

from .group import ParallelGroup, RankFailure, abort, all_reduce, broadcast, guarded, init, shutdown
from .leader import LeaderRunner, follow, leader_engine, release
from .load import load_shard
from .shard import shard_model, shard_weights

__all__ = ["LeaderRunner", "ParallelGroup", "RankFailure", "abort", "all_reduce", "broadcast",
           "follow", "guarded", "init", "leader_engine", "load_shard", "release",
           "shard_model", "shard_weights", "shutdown"]
