"""Builds the native CPU kernels (vllm_pypto._C) with the package: `pip install .` compiles
csrc/ against the installed torch. Use --no-build-isolation so the build sees the CPU torch
already in the environment instead of fetching one."""

from glob import glob

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[CppExtension(
        "vllm_pypto._C", sorted(glob("csrc/*.cpp")),
        # No -m ISA flags: each ISA file sets its own per function (csrc/a8w8.h), so one build loads
        # on every x86-64 CPU. -fopenmp: at::parallel_for runs on the libgomp torch already loaded (same soname),
        # i.e. on the threads vLLM-CPU binds, not on a second pool.
        extra_compile_args=["-O3", "-fopenmp"], extra_link_args=["-fopenmp"])],
    cmdclass={"build_ext": BuildExtension},
)
