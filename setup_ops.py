"""Builds the paddle_step op library and installs the paddle_step package.

    python setup_ops.py install

Needs paddle installed first (paddlepaddle, or paddlepaddle-gpu: one name per build).
Before building, it installs the runtime dependencies of requirements.txt that are
missing, with pip (released wheels). They are not handed to Paddle's setup(): its
installer would fetch them through easy_install as eggs (pre-releases included) and then
rename every native module in them to *_pd_.so, which breaks those packages.

Builds the CUDA kernels too when the installed paddle is compiled with CUDA
and nvcc is found (CUDA_HOME, else /usr/local/cuda, else PATH); set
PADDLE_STEP_CPU_ONLY=1 to skip them. CUDA architectures come from
PADDLE_CUDA_ARCH_LIST (default "80;90").
"""

# zlib must be loaded before paddle: otherwise the egg step segfaults in
# deflateReset (paddle ships a zlib of its own).
import zlib  # noqa: F401  isort: skip

import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

try:
    import paddle
except ModuleNotFoundError as error:
    if error.name != "paddle":
        raise
    sys.exit("paddle_step: paddle is not installed; run `python -m pip install "
             "paddlepaddle==3.3.1` (CPU) or `python -m pip install paddlepaddle-gpu==2.6.2` "
             "(CUDA 11.8), then `python setup_ops.py install` again")
from paddle.utils.cpp_extension import CppExtension, CUDAExtension, setup
from setuptools import find_packages
from setuptools.command.install_lib import install_lib

ROOT = os.path.dirname(os.path.abspath(__file__))
OPS = os.path.join(ROOT, "ops")
REQUIREMENTS = os.path.join(ROOT, "requirements.txt")
# The op library's name: also the name of its pybind11 module (ops/bindings.cc).
LIBRARY_NAME = "paddle_step_ops"


def requirements(path):
    """``(name, version specifier)`` of each line of a requirements file (one plain
    requirement a line, such as ``numpy`` or ``llguidance>=1.0``)."""
    found = []
    with open(path) as lines:
        for line in lines:
            line = line.split("#", 1)[0].strip()
            if line:
                name = re.match(r"[A-Za-z0-9._-]+", line).group(0)
                found.append((name, line[len(name):].strip()))
    return found


def is_met(name, specifier):
    """True when ``name`` is installed in a version ``specifier`` allows. Without the
    packaging library to read a specifier, pip decides (it leaves met ones alone)."""
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    if not specifier:
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return False
    return SpecifierSet(specifier).contains(version, prereleases=True)


def install_runtime_requirements(path):
    """pip-installs the requirements file ``path`` when any of it is missing or in a
    version it does not allow; exits with the command to run by hand when pip fails (no
    registry reachable, say)."""
    missing = [name + specifier for name, specifier in requirements(path)
               if not is_met(name, specifier)]
    if not missing:
        return
    command = [sys.executable, "-m", "pip", "install", "-r", path]
    print(f"paddle_step: installing the runtime dependencies ({', '.join(missing)}): "
          + " ".join(command), flush=True)
    if subprocess.call(command) != 0:
        sys.exit(f"paddle_step: could not install {', '.join(missing)}; run "
                 f"`{sys.executable} -m pip install -r {path}` where a package index "
                 "is reachable, then `python setup_ops.py install` again")


def find_cuda_home():
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    nvcc_on_path = shutil.which("nvcc")
    if nvcc_on_path:
        candidates.append(os.path.dirname(os.path.dirname(nvcc_on_path)))
    for home in candidates:
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return home
    return None


def gencode_flags():
    arch_list = os.environ.get("PADDLE_CUDA_ARCH_LIST", "80;90")
    flags = []
    for arch in re.split(r"[;,\s]+", arch_list.strip()):
        if arch:
            sm = arch.replace(".", "")
            flags += ["-gencode", f"arch=compute_{sm},code=sm_{sm}"]
    return flags


def make_extension():
    cc_sources = sorted(glob.glob(os.path.join(OPS, "*.cc")))
    # ops/include: the framework-free kernels; ops/paddle_glue: the headers of
    # the Paddle glue (validation, entry points, registration).
    include_dirs = [os.path.join(OPS, "include"),
                    os.path.join(OPS, "paddle_glue")]
    # An edited header rebuilds the library (setuptools compares them with its output).
    headers = sorted(glob.glob(os.path.join(OPS, "*", "*.h")))
    # -fno-trapping-math: no code here reads floating-point exception flags, and
    # with them assumed observable GCC keeps loops with float compares (the
    # sampler's exp, max and cuts) scalar. Results do not change.
    cxx_flags = ["-std=c++17", "-O3", "-fno-trapping-math"]
    cuda_home = find_cuda_home()
    use_cuda = (
        paddle.is_compiled_with_cuda()
        and cuda_home is not None
        and os.environ.get("PADDLE_STEP_CPU_ONLY") != "1"
    )
    if not use_cuda:
        print("paddle_step: building the CPU kernels only")
        return CppExtension(
            sources=cc_sources,
            include_dirs=include_dirs,
            depends=headers,
            extra_compile_args={"cxx": cxx_flags},
        )
    os.environ["CUDA_HOME"] = cuda_home
    # CUDA 13 moved thrust and cub under include/cccl.
    include_dirs += [os.path.join(cuda_home, "include"),
                     os.path.join(cuda_home, "include", "cccl")]
    # PADDLE_WITH_CUDA exposes Tensor::stream() to the C++ glue.
    cuda_defines = ["-DPADDLE_STEP_WITH_CUDA", "-DPADDLE_WITH_CUDA"]
    print(f"paddle_step: building CPU and CUDA kernels with {cuda_home}")
    return CUDAExtension(
        sources=cc_sources + sorted(glob.glob(os.path.join(OPS, "gpu", "*.cu"))),
        include_dirs=include_dirs,
        depends=headers,
        extra_compile_args={
            "cxx": cxx_flags + cuda_defines,
            "nvcc": ["-std=c++17", "-O3"] + cuda_defines + gencode_flags(),
        },
    )


class CleanInstallLib(install_lib):
    """Installs the package as the sources are now: a module removed or moved since the
    last install would otherwise stay importable from site-packages. Also drops the empty
    folders Paddle's build_ext leaves under build_lib/build/ (it writes the object files
    there and deletes them after linking), which would install as a package named
    `build`, shadowing PyPA's, and its build record build_lib/version.txt (the flags it
    compiled with), which would land at the top of site-packages."""

    def run(self):
        tree = os.path.join(self.build_dir, "build")
        if os.path.isdir(tree) and not any(files for _, _, files in os.walk(tree)):
            shutil.rmtree(tree)
        installed = os.path.join(self.install_dir, "paddle_step")
        if os.path.isdir(installed):
            shutil.rmtree(installed)
        super().run()
        record = os.path.join(self.install_dir, "version.txt")
        if os.path.isfile(os.path.join(self.build_dir, "version.txt")) and os.path.isfile(record):
            os.remove(record)


def main():
    arguments = set(sys.argv[1:])
    if {"install", "develop"} & arguments and not {"--help", "-h"} & arguments:
        install_runtime_requirements(REQUIREMENTS)
    setup(
        name=LIBRARY_NAME,
        version="0.1.0",
        ext_modules=make_extension(),
        cmdclass={"install_lib": CleanInstallLib},
        # paddle_step.layers may have no __init__.py yet (a namespace package), which
        # find_packages skips.
        packages=sorted(set(find_packages("python")) | {"paddle_step.layers"}),
        package_dir={"": "python"},
        # The shipped default model (weights, tokenizer, configs) travels with the package.
        package_data={"paddle_step": ["assets/*/*.json", "assets/*/*.safetensors", "assets/*.md"]},
        # No install_requires: install_runtime_requirements() has run pip (see the docstring).
        # Nor paddle: it comes as paddlepaddle or paddlepaddle-gpu (one name per build).
    )


if __name__ == "__main__":
    main()
