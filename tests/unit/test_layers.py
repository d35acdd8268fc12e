"""The layer rules of csrc/ hold, and .ci/check_layers (which CI runs) notices a break."""

import os
import shutil
import subprocess
import sys

import pytest

from paths import REPO as ROOT

pytestmark = pytest.mark.multiprocess

CHECK = os.path.join(ROOT, ".ci", "check_layers")


def _check(csrc: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECK, csrc], capture_output=True, text=True,
                          timeout=60)


def test_the_tree_follows_the_rules():
    result = _check(os.path.join(ROOT, "csrc"))
    assert result.returncode == 0, result.stdout


def test_each_kind_of_break_is_named(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(os.path.join(ROOT, "csrc"), csrc)
    planted = {
        "kernels/cpu.cpp": '#include "transport/transport.h"\n',
        "transport/shm.cpp": '#include "algorithms/collectives.h"\n',
        "algorithms/collectives.cpp": '#include "transport/shm.h"\n',
        "bindings.cpp": '#include "transport/shm.h"\n',
        "kernels/cuda.cu": "#include <ATen/core/Tensor.h>\n",
    }
    for path, line in planted.items():
        with open(csrc / path, "a") as f:
            f.write(line)
    result = _check(str(csrc))
    assert result.returncode == 1
    for path, line in planted.items():
        target = line.split()[1].strip('"<>')
        assert any(l.startswith(path) and target in l for l in result.stdout.splitlines()), (
            path, result.stdout)
