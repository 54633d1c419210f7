"""zerompi: ZeRO data-parallel training of PyTorch models over MPI.

    import zerompi
    engine = zerompi.initialize(model, zerompi.ZeroConfig(stage=3))
    loss = loss_fn(engine(x), y); engine.backward(loss); engine.step()

Run under any MPI launcher: ``mpiexec -n 4 python -m mpi4py train.py``.
"""
from zerompi.config import ZeroConfig
from zerompi.engine import Engine, Stats
from zerompi.entry import initialize
from zerompi import compat  # noqa: E402,F401  registers the DeepSpeed config dialect that ZeroConfig.from_file reads
from zerompi.errors import CheckpointError, ConfigError, ModelMismatchError, Recovered, UsageError, ZeroMPIError

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "Engine", "ModelMismatchError", "Recovered", "Stats", "UsageError",
    "ZeroConfig", "ZeroMPIError", "initialize", "__version__",
]
