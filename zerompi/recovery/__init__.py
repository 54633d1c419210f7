"""``fault_tolerance=True``: the engine that survives a lost rank (engine.py) and where the lost state
comes back from (sources.py)."""
from zerompi.recovery.engine import FaultTolerance, RecoveryReport, ResilientEngine

__all__ = ["FaultTolerance", "RecoveryReport", "ResilientEngine"]
