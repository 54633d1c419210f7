# Spack recipe for zerompi. There is no release tarball: the environment in
# spack.yaml (repository root) builds it from this checkout with `develop:`.
from spack.package import *  # noqa: F401,F403

try:  # Spack >= 1.0 keeps the build systems in its builtin package repository
    from spack_repo.builtin.build_systems.python import PythonPackage
except ImportError:  # Spack 0.x: spack.package exports them
    pass


class PyZerompi(PythonPackage):
    """ZeRO (stages 0-3) data-parallel training of PyTorch models over MPI, with HDF5 checkpoints."""

    license("BSD-3-Clause")

    # Must match pyproject.toml's project.version; the source comes from `spack develop`.
    version("0.1.0")

    # pyproject.toml: requires-python, [build-system] requires, [project] dependencies.
    depends_on("python@3.11:", type=("build", "run"))
    depends_on("py-setuptools@64:", type="build")
    depends_on("py-mpi4py@4.0:", type=("build", "run"))
    depends_on("py-torch@2.4:", type=("build", "run"))
    depends_on("py-numpy@1.24:", type=("build", "run"))
    depends_on("py-h5py@3.8:", type=("build", "run"))

    # pyproject.toml's "test" extra.
    depends_on("py-pytest@7:", type="test")
    depends_on("py-hypothesis@6:", type="test")
    depends_on("py-pyyaml@6:", type="test")
    depends_on("py-transformers@4.46:", type="test")
    depends_on("py-accelerate@1.0:", type="test")
    depends_on("py-peft@0.13:", type="test")
    depends_on("py-deepspeed@0.16:", type="test")
    depends_on("py-trl@1.16:", type="test")
    depends_on("py-datasets@4.7:", type="test")
    depends_on("py-lightning@2.6:", type="test")
    depends_on("py-mkdocs@1.6:", type="test")

    import_modules = ["zerompi", "zerompi.checkpoint", "zerompi.models"]
