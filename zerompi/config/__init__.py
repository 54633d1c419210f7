"""The engine's configuration: :class:`ZeroConfig`, the choices it parses once and
the policies its sections build."""
from zerompi.config.choices import (CheckpointLayout, CudaAware, Device, DType, GradQuant, Hierarchy, NonFinite,
                                    Offload, Progress, Schedule, Stage, UpdateSchedule, WeightQuant)
from zerompi.config.sections import (BatchPolicy, CheckpointPolicy, CompressionPolicy, LrSchedulePolicy, OffloadPolicy,
                                     OptimizerPolicy, OverlapPolicy, PrecisionPolicy, RecoveryPolicy, ReliabilityPolicy,
                                     RuntimePolicy, ShardingPolicy, TopologyPolicy)
from zerompi.config.zero import ZeroConfig

__all__ = ["ZeroConfig",
           "Stage", "DType", "Offload", "Device", "CudaAware", "Progress", "Hierarchy", "NonFinite", "Schedule",
           "CheckpointLayout", "WeightQuant", "GradQuant", "UpdateSchedule",
           "BatchPolicy", "CheckpointPolicy", "CompressionPolicy", "LrSchedulePolicy", "OffloadPolicy", "OptimizerPolicy",
           "OverlapPolicy", "PrecisionPolicy", "RecoveryPolicy", "ReliabilityPolicy", "RuntimePolicy", "ShardingPolicy",
           "TopologyPolicy"]
