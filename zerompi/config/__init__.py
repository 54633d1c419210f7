"""The engine's configuration: :class:`ZeroConfig`, the choices it parses once and
the policies that group its fields."""
from zerompi.config.choices import (CheckpointLayout, CudaAware, Device, DType, GradQuant, Hierarchy, NonFinite,
                                    Offload, Progress, Schedule, Stage, UpdateSchedule, WeightQuant)
from zerompi.config.policies import (CheckpointPolicy, CompressionPolicy, LrSchedulePolicy, OffloadPolicy, OptimizerPolicy,
                                     OverlapPolicy, PrecisionPolicy, ReliabilityPolicy, TopologyPolicy)
from zerompi.config.zero import ZeroConfig

__all__ = ["ZeroConfig",
           "Stage", "DType", "Offload", "Device", "CudaAware", "Progress", "Hierarchy", "NonFinite", "Schedule",
           "CheckpointLayout", "WeightQuant", "GradQuant", "UpdateSchedule",
           "OptimizerPolicy", "LrSchedulePolicy", "CheckpointPolicy", "PrecisionPolicy", "OffloadPolicy", "OverlapPolicy", "TopologyPolicy", "ReliabilityPolicy",
           "CompressionPolicy"]
