"""Builds pyddp._C against the installed torch (metadata: pyproject.toml).

Which extension:
- CUDAExtension, with the CUDA and NCCL parts, when torch is a CUDA build,
  nvcc is found (CUDA_HOME, defaulting to /usr/local/cuda) with the same
  CUDA major version as torch.version.cuda, and NCCL's headers and library
  are found;
- CppExtension (CPU only) otherwise, with a warning saying why when torch is
  a CUDA build.
The module links libstdc++ dynamically whatever the compiler adds, and the
build fails if it carries a C++ runtime of its own (pyddp/_runtime.py).
PYDDP_BUILD_CUDA=0/1 forces the choice (1 fails loudly when a CUDA build is
impossible). Release builds carry no debug info (-g0); DEBUG=1 builds -O0 -g
with assertions. PYDDP_BUILD_TESTING=0
leaves out csrc/testing/ (the _testing submodule pyddp's tests use).
PYDDP_SANITIZE=address,undefined (or thread) instruments the C++ sources
with gcc's sanitizers (-O1 -g1); Python is not instrumented, so the runtime
must be preloaded into it (LD_PRELOAD=$(gcc -print-file-name=libasan.so) ...;
.ci/run shows how).

Sources: every .cpp under csrc/, except the CUDA-only ones listed in
CUDA_SOURCES (with every .cu file) outside CUDA builds, and csrc/testing/
when testing is off. CUDA builds define PYDDP_WITH_CUDA, testing builds
PYDDP_WITH_TESTING.

NCCL: the one torch itself loads, from the nvidia-nccl-cu13 wheel
(site-packages/nvidia/nccl/{include,lib}); PYDDP_NCCL_HOME=<dir with
include/nccl.h and lib/libnccl.so.2> overrides. The wheel ships only
libnccl.so.2, so the link names that file, with an rpath to its directory.

GPU architectures: TORCH_CUDA_ARCH_LIST when set (CI sets 9.0: H100/H200,
the shortest build). When unset, torch's own default, which is the visible
GPUs' architectures; with no GPU visible (where torch's default fails),
every architecture torch itself was built for, so the extension runs on any
GPU torch runs on, at the cost of a longer build.
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys
import warnings

# cpp_extension reads CUDA_HOME when imported. /usr/local/bin/nvcc may be a
# wrapper script that makes it guess /usr/local, whose lib has no cudart.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# pyddp/_runtime.py alone: the package's __init__ needs the extension this file builds.
_spec = importlib.util.spec_from_file_location("_pyddp_runtime",
                                               os.path.join(HERE, "pyddp", "_runtime.py"))
runtime = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runtime)
DEBUG = os.environ.get("DEBUG", "0") == "1"
SANITIZE = os.environ.get("PYDDP_SANITIZE", "")
TESTING = os.environ.get("PYDDP_BUILD_TESTING", "1") != "0"
NCCL_LIB = "libnccl.so.2"
# The .cpp files that need CUDA or NCCL (every .cu file does too).
CUDA_SOURCES = {
    os.path.join("csrc", *path.split("/"))
    for path in (
        "backend/cuda_stream.cpp",
        "backend/cuda_work.cpp",
        "backend/device_executor.cpp",
        "backend/nccl_engine.cpp",
        "backend/work_monitor.cpp",
        "transport/cuda_ipc.cpp",
        "transport/nccl_comm.cpp",
        "transport/nccl_transport.cpp",
    )
}


def nvcc_version(cuda_home: str):
    """(major, minor) of CUDA_HOME's nvcc, or None when it cannot be run."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def find_nccl():
    """(include dir, lib dir) of NCCL, or None. PYDDP_NCCL_HOME wins; else the
    nvidia-nccl wheel beside torch or anywhere on sys.path."""
    home = os.environ.get("PYDDP_NCCL_HOME")
    if home:
        candidates = [home]
    else:
        roots = [os.path.dirname(os.path.dirname(torch.__file__))] + sys.path
        candidates = [os.path.join(r, "nvidia", "nccl") for r in roots if r]
    for c in candidates:
        inc, lib = os.path.join(c, "include"), os.path.join(c, "lib")
        if os.path.exists(os.path.join(inc, "nccl.h")) and os.path.exists(
                os.path.join(lib, NCCL_LIB)):
            return inc, lib
    if home:
        raise RuntimeError(f"PYDDP_NCCL_HOME={home} has no include/nccl.h and lib/{NCCL_LIB}")
    return None


def cuda_plan():
    """(build CUDA?, NCCL's include and lib dirs)."""
    forced = os.environ.get("PYDDP_BUILD_CUDA")
    if forced == "0":
        return False, None
    why = None
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU build"
    elif cpp_extension.CUDA_HOME is None:
        why = "no CUDA toolkit found (set CUDA_HOME to the directory with bin/nvcc)"
    else:
        have = nvcc_version(cpp_extension.CUDA_HOME)
        want = int(torch.version.cuda.split(".")[0])
        if have is None:
            why = f"{cpp_extension.CUDA_HOME}/bin/nvcc cannot be run"
        elif have[0] != want:
            why = (f"nvcc in {cpp_extension.CUDA_HOME} is CUDA {have[0]}.{have[1]} but torch "
                   f"was built with CUDA {torch.version.cuda}: set CUDA_HOME to a CUDA "
                   f"{want}.x toolkit")
    nccl = None if why else find_nccl()
    if why is None and nccl is None:
        why = ("NCCL not found: install nvidia-nccl-cu" + torch.version.cuda.split(".")[0]
               + " or set PYDDP_NCCL_HOME")
    if why is None:
        return True, nccl
    if forced == "1":
        raise RuntimeError(f"PYDDP_BUILD_CUDA=1, but the CUDA build is impossible: {why}")
    if torch.version.cuda is not None:
        warnings.warn(f"pyddp: building the CPU-only extension (no CUDA, no NCCL): {why}")
    return False, None


def default_arch_list():
    """TORCH_CUDA_ARCH_LIST when unset and no GPU is visible (see the docstring)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return None
    archs = []
    for a in torch.cuda.get_arch_list():  # "sm_90", "sm_100", "sm_90a", "compute_90"
        m = re.fullmatch(r"sm_(\d+)(\d)(a?)", a)
        if m:
            archs.append(f"{m.group(1)}.{m.group(2)}{m.group(3)}")
    return ";".join(archs) + "+PTX" if archs else "9.0"


def sources(cuda: bool, testing: bool) -> list:
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    missing = CUDA_SOURCES - set(cpp)
    if missing:
        raise RuntimeError(f"setup.py: CUDA_SOURCES names files that do not exist: {sorted(missing)}")
    chosen = cpp + cu if cuda else [s for s in cpp if s not in CUDA_SOURCES]
    if not testing:
        chosen = [s for s in chosen if not s.startswith(os.path.join("csrc", "testing") + os.sep)]
    return chosen


def sanitizer_flags() -> list:
    """gcc flags for PYDDP_SANITIZE (a -fsanitize= list), checked so a typo fails here."""
    if not SANITIZE:
        return []
    known = {"address", "undefined", "thread", "leak"}
    names = SANITIZE.split(",")
    if not set(names) <= known or ("thread" in names and len(names) > 1):
        raise RuntimeError(f"PYDDP_SANITIZE={SANITIZE!r}: use a list of {sorted(known)}, "
                           "with thread alone")
    # vptr checks need the type info of every class a pointer may hold, and
    # torch's and pybind11's are spread over libraries built without it.
    vptr = ["-fno-sanitize=vptr"] if "undefined" in names else []
    return [f"-fsanitize={SANITIZE}", *vptr, "-fno-omit-frame-pointer"]


def extension():
    cuda, nccl = cuda_plan()
    # Python's own CFLAGS carry -DNDEBUG and -g. A debug build wants assertions.
    opt = ["-O0", "-g", "-UNDEBUG"] if DEBUG else ["-O1"] if SANITIZE else ["-O3"]
    # g++'s debug info, after Python's -g (.cu files keep nvcc's defaults): full
    # for DEBUG=1; line tables only (-g1) for a sanitizer build, so reports keep
    # file and line while a unit compiles in about two thirds of the time
    # (arg_checks.cpp under ASan+UBSan: 71 -> 49 s); none (-g0) for a release
    # build, which nearly halves its compile time (torch 2.13, 2 cores, CPU-only,
    # from scratch: 381 -> 213 s; the .so 54 -> 2.6 MB).
    debug_info = [] if DEBUG else ["-g1"] if SANITIZE else ["-g0"]
    sanitize = sanitizer_flags()
    cxx = ["-std=c++20", *opt, *debug_info, "-Wall", "-Wno-unused-parameter", *sanitize]
    kwargs = dict(
        name="pyddp._C",
        sources=sources(cuda, TESTING),
        include_dirs=[os.path.join(HERE, "csrc")],
        extra_compile_args={"cxx": cxx},
        # The shared libstdc++ by file name, whatever archive the compiler would pick
        # (runtime.LINK_RUNTIME says how). BuildExtension below checks the outcome
        # (pyddp/_runtime.py says why two runtimes break).
        extra_link_args=[*sanitize, runtime.LINK_RUNTIME],
        define_macros=[("PYDDP_WITH_TESTING", "1")] if TESTING else [],
    )
    if not cuda:
        return cpp_extension.CppExtension(**kwargs)
    arch = default_arch_list()
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    nccl_inc, nccl_lib = nccl
    kwargs["include_dirs"].append(nccl_inc)
    kwargs["extra_compile_args"]["nvcc"] = ["-std=c++20", *opt]
    kwargs["define_macros"].append(("PYDDP_WITH_CUDA", "1"))
    kwargs["extra_link_args"] += [f"-L{nccl_lib}", f"-l:{NCCL_LIB}", f"-Wl,-rpath,{nccl_lib}"]
    return cpp_extension.CUDAExtension(**kwargs)


class BuildExtension(cpp_extension.BuildExtension):
    """torch's build, then a check that the module uses the process's C++ runtime."""

    def build_extension(self, ext):
        super().build_extension(ext)
        why = runtime.own_runtime(self.get_ext_fullpath(ext.name))
        if why:
            raise RuntimeError(f"setup.py: {why}")


# The package's metadata and extras are in pyproject.toml; this file adds
# the extension.
setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
