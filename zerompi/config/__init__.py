"""The engine's configuration: :class:`ZeroConfig` and the choices it parses once."""
from zerompi.config.zero import ZeroConfig

__all__ = ["ZeroConfig"]
