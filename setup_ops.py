"""Builds the paddle_step op library and installs the paddle_step package.

    python setup_ops.py install

Builds the CUDA kernels too when the installed paddle is compiled with CUDA
and nvcc is found (CUDA_HOME, else /usr/local/cuda, else PATH); set
PADDLE_STEP_CPU_ONLY=1 to skip them. CUDA architectures come from
PADDLE_CUDA_ARCH_LIST (default "80;90").
"""

# zlib must be loaded before paddle: otherwise the egg step segfaults in
# deflateReset (paddle ships a zlib of its own).
import zlib  # noqa: F401  isort: skip

import glob
import os
import re
import shutil

import paddle
from paddle.utils.cpp_extension import CppExtension, CUDAExtension, setup
from setuptools import find_packages

ROOT = os.path.dirname(os.path.abspath(__file__))
OPS = os.path.join(ROOT, "ops")
# The op library's name: also the name of its pybind11 module (ops/bindings.cc).
LIBRARY_NAME = "paddle_step_ops"


def read_requirements(path):
    with open(path) as lines:
        return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


RUNTIME_REQUIREMENTS = read_requirements(os.path.join(ROOT, "requirements.txt"))


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
    cxx_flags = ["-std=c++17", "-O3"]
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
        extra_compile_args={
            "cxx": cxx_flags + cuda_defines,
            "nvcc": ["-std=c++17", "-O3"] + cuda_defines + gencode_flags(),
        },
    )


setup(
    name=LIBRARY_NAME,
    version="0.1.0",
    ext_modules=make_extension(),
    # paddle_step.layers may have no __init__.py yet (a namespace package), which
    # find_packages skips.
    packages=sorted(set(find_packages("python")) | {"paddle_step.layers"}),
    package_dir={"": "python"},
    # The shipped default model (weights, tokenizer, configs) travels with the package.
    package_data={"paddle_step": ["assets/*/*.json", "assets/*/*.safetensors", "assets/*.md"]},
    # Not paddle: it comes as paddlepaddle or paddlepaddle-gpu (one name per build), and
    # naming either would make pip replace the other; the build needs it installed anyway.
    install_requires=RUNTIME_REQUIREMENTS,
)
