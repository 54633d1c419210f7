"""The config's sections: one concern each, with its keys (ZeroConfig's flat fields, documented there)
and the frozen policy built from them once, which is what a component takes."""
from zerompi.config.sections.batch import BatchPolicy
from zerompi.config.sections.checkpointing import CheckpointPolicy
from zerompi.config.sections.compression import CompressionPolicy
from zerompi.config.sections.offload import OffloadPolicy
from zerompi.config.sections.optimization import LrSchedulePolicy, OptimizerPolicy
from zerompi.config.sections.overlap import OverlapPolicy
from zerompi.config.sections.precision import PrecisionPolicy
from zerompi.config.sections.recovery import RecoveryPolicy
from zerompi.config.sections.reliability import ReliabilityPolicy
from zerompi.config.sections.runtime import RuntimePolicy
from zerompi.config.sections.sharding import ShardingPolicy, TopologyPolicy

__all__ = ["BatchPolicy", "CheckpointPolicy", "CompressionPolicy", "LrSchedulePolicy", "OffloadPolicy", "OptimizerPolicy",
           "OverlapPolicy", "PrecisionPolicy", "RecoveryPolicy", "ReliabilityPolicy", "RuntimePolicy", "ShardingPolicy",
           "TopologyPolicy"]
