"""autopar: an auto-parallel compiler for PyTorch.

    pmodel = autopar.parallelize(model, autopar.Mesh(4), example_inputs=(x,),
                                 loss_fn=F.cross_entropy, example_target=y, mode="auto")
"""
from autopar.api import parallelize, plan
from autopar.collectives.comm import count_collectives
from autopar.core.context import (ParallelMode, get_auto_parallel_context, reset_auto_parallel_context,
                             set_auto_parallel_context)
from autopar.core.errors import CheckpointError, CommError, RankMismatchError, TraceError
from autopar.core.mesh import Mesh
from autopar.modules.parallel_module import ParallelModule
from autopar.plan.plan import Plan, PlanError
from autopar.runtime.data import DataParallelLoader, DataParallelSampler
from autopar.runtime.launch import RankError, launch
from autopar.runtime.resume import CheckpointManager, latest_checkpoint
from autopar.sharding.placements import Partial, Replicate, Shard
from autopar.solver.annotations import clear_annotations, op_strategy, pipeline_stage, shard, shard_input

__all__ = ["parallelize", "plan", "Mesh", "ParallelMode", "Plan", "ParallelModule", "Shard", "Replicate", "Partial",
           "shard", "shard_input", "op_strategy", "pipeline_stage", "clear_annotations", "set_auto_parallel_context",
           "get_auto_parallel_context", "reset_auto_parallel_context", "launch", "RankError", "PlanError",
           "TraceError", "CheckpointError", "CommError", "RankMismatchError", "count_collectives", "CheckpointManager",
           "latest_checkpoint", "DataParallelSampler", "DataParallelLoader"]
__version__ = "0.1.0"
