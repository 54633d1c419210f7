"""Lightning over zerompi: ``ZeroMPIStrategy``, a Lightning strategy whose ranks are MPI's.

    from zerompi.compat.lightning import ZeroMPIStrategy
    trainer = Trainer(strategy=ZeroMPIStrategy(ZeroConfig(stage=3)), accelerator="cpu", devices=1)

Run with ``mpiexec -n 4 python -m mpi4py train.py``. Needs ``lightning`` (not a dependency of
zerompi: importing this module is what imports it).
"""
from zerompi.compat.lightning.strategy import ZeroMPIStrategy

__all__ = ["ZeroMPIStrategy"]
