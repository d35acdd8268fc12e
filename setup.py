"""Builds pyddp._C against the installed torch.

CppExtension when torch is a CPU build or no CUDA toolkit is found;
CUDAExtension (CUDA and NCCL sources, when they exist) when torch is a CUDA
build and CUDA_HOME has nvcc. PYDDP_BUILD_CUDA=0/1 forces the choice;
DEBUG=1 builds -O0 -g with assertions.
"""

import glob
import os

# cpp_extension reads CUDA_HOME when imported. /usr/local/bin/nvcc may be a
# wrapper script that makes it guess /usr/local, whose lib has no cudart.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"


def want_cuda() -> bool:
    forced = os.environ.get("PYDDP_BUILD_CUDA")
    if forced is not None:
        return forced == "1"
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def sources(cuda: bool) -> list:
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    return cpp + (cu if cuda else [])


def extension():
    cuda = want_cuda()
    # Python's own CFLAGS carry -DNDEBUG; a debug build wants assertions.
    opt = ["-O0", "-g", "-UNDEBUG"] if DEBUG else ["-O3"]
    cxx = ["-std=c++20", *opt, "-Wall", "-Wno-unused-parameter"]
    kwargs = dict(
        name="pyddp._C",
        sources=sources(cuda),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": cxx},
    )
    if cuda:
        kwargs["extra_compile_args"]["nvcc"] = ["-std=c++20", *opt]
        kwargs["define_macros"] = [("PYDDP_WITH_CUDA", "1")]
        return cpp_extension.CUDAExtension(**kwargs)
    return cpp_extension.CppExtension(**kwargs)


setup(
    name="pyddp",
    version="0.1.0",
    description="Collective communication and DDP for PyTorch: shared memory, CUDA IPC, NCCL",
    packages=find_packages(include=["pyddp", "pyddp.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch"],
)
