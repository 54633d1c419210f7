"""Lightning over zerompi: ``ZeroMPIStrategy``, a Lightning strategy whose ranks are MPI's.

    from zerompi.compat.lightning import ZeroMPIStrategy
    trainer = Trainer(strategy=ZeroMPIStrategy(ZeroConfig(stage=3)), accelerator="cpu", devices=1)
    trainer = Trainer(strategy="zerompi_stage_3", accelerator="cpu", devices=1)   # the same, by name


Run with ``mpiexec -n 4 python -m mpi4py train.py``. Needs ``lightning`` (not a dependency of
zerompi: importing this module is what imports it).
"""
from lightning.pytorch.strategies import StrategyRegistry

from zerompi.compat.lightning.strategy import ZeroMPIStrategy

ZeroMPIStrategy.register_strategies(StrategyRegistry)  # Trainer(strategy="zerompi"), "zerompi_stage_0".."_3"

__all__ = ["ZeroMPIStrategy"]
