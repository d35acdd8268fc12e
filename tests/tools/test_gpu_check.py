"""tests/gpu/check.sh on a machine without a GPU.

The script's functions are sourced into bash and run on logs in the formats
the steps print (rendered by the bench's and the DDP benchmark's own code
where there is one): the pytest counts, each step's verdict, the ratios taken
from the sweep, the summary table. Its process handling runs on real
processes: the Python hook that arms faulthandler in every interpreter, the
stack dump of an overrun step (Python through faulthandler, C++ through gdb
where installed) and the end of its process tree. Last, the whole script runs
with stand-ins for nvidia-smi, NVIDIA's MPS control and the steps' commands:
every step passing with MPS started and stopped around the right steps, a
daemon that was already running left alone, and a step that hangs being
dumped, stopped and reported while the check still ends within its cap.
"""

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest

from pyddp import devices
from pyddp.bench import ddp
from pyddp.bench.metrics import Result, Skipped
from pyddp.bench.peers import BASELINES
from pyddp.bench.report import render
from paths import REPO

pytestmark = pytest.mark.multiprocess

CHECK = os.path.join(REPO, "tests", "gpu", "check.sh")
SWEEP_OPS = ["all_reduce", "all_gather"]
BASH_TIMEOUT = 60
RUN_TIMEOUT = 180


def _bash(script: str, env: dict = None, timeout: float = BASH_TIMEOUT
          ) -> subprocess.CompletedProcess:
    """``script`` in bash with check.sh's functions and settings sourced."""
    return subprocess.run(["bash", "-c", f'source "{CHECK}"\n{script}'], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})))


def _call(function: str, *args: str) -> str:
    quoted = " ".join(f"'{a}'" for a in args)
    process = _bash(f"{function} {quoted}")
    assert process.stderr == "", process.stderr
    return process.stdout


def _write(path, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


# --- the script as a file ----------------------------------------------------------------------

def test_the_script_parses_and_passes_shellcheck():
    assert subprocess.run(["bash", "-n", CHECK], capture_output=True).returncode == 0
    if shutil.which("shellcheck") is None:
        return
    process = subprocess.run(["shellcheck", CHECK], capture_output=True, text=True)
    assert process.returncode == 0, process.stdout


# --- logs in, verdicts out ---------------------------------------------------------------------

PYTEST_CLOSED = """\
tests/test_gpu_collectives.py::test_stream_semantics PASSED                  [ 50%]
tests/test_gpu_collectives.py::test_all_reduce_every_dtype_and_op[nccl] SKIPPED [100%]
=========================== short test summary info ============================
SKIPPED [20] tests/test_gpu_collectives.py:40: 2 ranks on 1 GPU(s) need NCCL >= 2.30
== 1 failed, 197 passed, 20 skipped, 1454 deselected, 2 warnings in 113.21s (0:01:53) ==
"""

PYTEST_STOPPED = """\
tests/test_gpu_collectives.py::test_all_reduce_every_dtype_and_op[auto] PASSED [  1%]
tests/test_gpu_collectives.py::test_all_reduce_every_dtype_and_op[ring] PASSED [  2%]
tests/test_gpu_collectives.py::test_all_reduce_every_dtype_and_op[nccl] SKIPPED [  3%]
tests/test_gpu_collectives.py::test_half_types_accumulate_in_fp32[auto] FAILED [  4%]
tests/test_gpu_collectives.py::test_results_are_bitwise_identical_across_ranks[auto] ERROR [  5%]
tests/test_gpu_collectives.py::test_results_are_bitwise_identical_across_ranks[ring]
"""


def test_pytest_counts_come_from_the_closing_line_or_the_lines_of_a_stopped_run(tmp_path):
    closed = _write(tmp_path / "closed.log", PYTEST_CLOSED)
    assert _call("pytest_counts", closed) == "197 passed, 1 failed, 20 skipped"
    stopped = _write(tmp_path / "stopped.log", PYTEST_STOPPED)
    assert _call("pytest_counts", stopped) == "2 passed, 1 failed, 1 skipped, 1 errors"


def test_pytest_verdicts(tmp_path):
    closed = _write(tmp_path / "closed.log", PYTEST_CLOSED.replace("1 failed, ", ""))
    assert _call("judge_pytest", closed, "0") == "ok\t197 passed, 0 failed, 20 skipped\n"
    assert _call("judge_pytest", closed, "1") == (
        "FAILED\t197 passed, 0 failed, 20 skipped (pytest exit 1)\n")
    none = _write(tmp_path / "none.log", "=== 218 deselected in 4.17s ===\n")
    assert _call("judge_pytest", none, "5") == "skipped\tno test was collected\n"
    assert _call("judge_torch_tests", none, "5") == (
        "skipped\tno CUDA test has 'torch' in its name (pytest -m cuda -k torch)\n")


def _result(peer: str, size: int, time_us: float, op: str = "all_reduce", wrong=0) -> Result:
    return Result.from_timing(op, peer, f"{peer} detail", "cuda", 2, size, size // 4, "float32",
                              "sum", -1, 1, time_us / 1e6,
                              None if peer == "limit_cuda" else wrong)


def _sweep_output(wrong: int = 0, without: str = "") -> str:
    """What the check's sweep prints, rendered by the bench's report: NCCL skipped, the rest
    on two sizes of two ops."""
    names = ["gloo_cuda", "pyddp_ipc_two_shot", "symm_mem_one_shot", "limit_cuda"]
    times = {"gloo_cuda": 400.0, "pyddp_ipc_two_shot": 80.0, "symm_mem_one_shot": 20.0,
             "limit_cuda": 10.0}
    results = [_result(name, size, times[name] * factor, op, wrong if name == names[1] else 0)
               for op in SWEEP_OPS for size, factor in ((16384, 1), (1 << 26, 100))
               for name in names if name != without
               if not (name == "symm_mem_one_shot" and op != "all_reduce")]
    skipped = [Skipped("nccl", None, "2 ranks on 1 GPU(s) need NCCL >= 2.30, torch has 2.28"),
               Skipped("symm_mem_one_shot", "all_gather",
                       "torch.ops.symm_mem.one_shot_all_reduce is an all_reduce")]
    if without:
        skipped.append(Skipped(without, None, "no CUDA device"))
    header = "# pyddp.bench: 2 ranks, all_reduce, all_gather, float32, 16K to 64M\n"
    return header + render(results, skipped, SWEEP_OPS, ["nccl", *names], dict(BASELINES),
                           True) + "\n"


def test_sweep_verdicts(tmp_path):
    good = _write(tmp_path / "good.log", _sweep_output())
    status, numbers = _call("judge_main_sweep", good, "0").rstrip("\n").split("\t")
    assert status == "ok"
    assert numbers == ("wrong elements: 0; ran: gloo_cuda,pyddp_ipc_two_shot,symm_mem_one_shot,"
                       "limit_cuda; skipped: nccl (2 ranks on 1 GPU(s) need NCCL >= 2.30, "
                       "torch has 2.28)")
    assert _call("judge_main_sweep", good, "1").startswith("FAILED\t")
    wrong = _write(tmp_path / "wrong.log", _sweep_output(wrong=3))
    assert _call("judge_main_sweep", wrong, "0").startswith("FAILED\twrong elements: 12;")
    no_gloo = _write(tmp_path / "no_gloo.log", _sweep_output(without="gloo_cuda"))
    verdict = _call("judge_main_sweep", no_gloo, "0")
    assert verdict.startswith("FAILED\t") and verdict.endswith("; did not run: gloo_cuda\n")
    assert "gloo_cuda (no CUDA device)" in verdict
    # The pass without MPS needs the cuda_ipc peers, not gloo.
    assert _call("judge_nomps_sweep", no_gloo, "0").endswith("did not run: pyddp_ipc_one_shot\n")


def test_the_sweep_ratios_are_its_cuda_summaries(tmp_path):
    log = _write(tmp_path / "sweep.log", _sweep_output())
    ratios = _call("sweep_ratios", log)
    blocks = [b for b in ratios.split("\n\n") if b.strip()]
    assert [b.splitlines()[0].split(" (")[0] for b in blocks] == [
        f"# summary: {op} on cuda, speed-up over {reference}"
        for op in SWEEP_OPS for reference in ("gloo_cuda", "limit_cuda")]
    first = {line.split()[0]: line.split()[1:] for line in blocks[0].splitlines()[2:]}
    # gloo_cuda time / peer time: 400 / 80, 400 / 20, 400 / 10
    assert first["16384"] == ["400.0", "5.00x", "20.00x", "40.00x"]
    assert "# all_reduce  peer:" not in ratios and "# skipped" not in ratios


def _train_output(gpus: int, accuracy: float) -> str:
    """What train.py prints on CUDA, its progress bar (tqdm, redrawn with carriage returns,
    on the lines of the epochs and of the final accuracy) included."""
    note = devices.sharing_note(2, gpus)
    bar = "100%|##########| 220/220 [00:01<00:00, 131.10step/s, epoch=5, loss=0.075]\r"
    return "\n".join(line for line in (
        "digits: 1437 train / 360 test images; 2 rank(s), global batch 32 (16 per rank), "
        f"75338 parameters, on cuda ({gpus} GPU(s), NVIDIA H200)",
        note,
        f"{bar}{' ' * 72}\repoch  5/5  loss 0.0621  test accuracy {accuracy:5.2f}%    51234 "
        "samples/s",
        f"{bar}{' ' * 72}\rfinal test accuracy: {accuracy:.2f}% (2 rank(s))") if line) + "\n"


def test_train_verdicts(tmp_path):
    shared = _write(tmp_path / "shared.log", _train_output(1, 97.5))
    assert _call("judge_train", shared, "0", "1", "2") == (
        "ok\tfinal accuracy 97.50%; 2 ranks on 1 GPU(s)\n")
    own = _write(tmp_path / "own.log", _train_output(2, 96.25))
    assert _call("judge_train", own, "0", "2", "2") == (
        "ok\tfinal accuracy 96.25%; 2 GPU(s) for 2 ranks\n")
    # Ranks sharing a GPU must say so; the accuracy must reach MIN_ACCURACY.
    assert _call("judge_train", own, "0", "1", "2").startswith(
        'FAILED\tfinal accuracy 96.25%; no line says "2 ranks on 1 GPU(s)"')
    low = _write(tmp_path / "low.log", _train_output(1, 89.99))
    assert _call("judge_train", low, "0", "1", "2") == (
        "FAILED\tfinal accuracy 89.99% (needs >= 90%); 2 ranks on 1 GPU(s)\n")
    assert _call("judge_train", shared, "1", "1", "2").startswith("FAILED\t")
    empty = _write(tmp_path / "empty.log", "")
    assert _call("judge_train", empty, "0", "1", "2") == (
        'FAILED\tfinal accuracy none% (needs >= 90%); no line says "2 ranks on 1 GPU(s)"\n')


def _ddp_output(identical: bool) -> str:
    setup = ddp.Setup("cuda", "gloo", "2 ranks on 1 GPU(s) need NCCL >= 2.30, torch has 2.28")
    base, ours, theirs = setup.variants
    report = {"step_s": {base: [0.010, 0.011, 0.010], ours: [0.030, 0.031, 0.030],
                         theirs: [0.060, 0.061, 0.060]},
              "pyddp_wait_s": 0.004, "identical": identical,
              "pyddp_transports": {"cuda": "cuda_ipc"}, "device_name": "NVIDIA H200"}
    return ddp._render(report, setup) + "\n"


def test_ddp_verdicts(tmp_path):
    good = _write(tmp_path / "good.log", _ddp_output(True))
    # pyddp's overhead 20 ms over torch DDP's 50 ms
    assert _call("judge_ddp", good, "0") == (
        "ok\toverhead / torch DDP's 0.40x; bitwise identical: yes; torch DDP over gloo\n")
    differ = _write(tmp_path / "differ.log", _ddp_output(False))
    assert _call("judge_ddp", differ, "0").startswith("FAILED\t")
    assert "bitwise identical: NO" in _call("judge_ddp", differ, "0")
    assert _call("judge_ddp", good, "1").startswith("FAILED\t")


def test_the_summary_table_and_its_verdict(tmp_path):
    passed = _write(tmp_path / "passed.tsv", "build\tok\t55\t\n"
                    "torch\tskipped\t3\tno CUDA test has 'torch' in its name\n")
    process = _bash(f"print_summary '{passed}' 345 300")
    assert process.returncode == 0
    lines = process.stdout.splitlines()
    assert lines[0].split() == ["step", "verdict", "secs", "numbers"]
    assert lines[2].split()[:3] == ["torch", "skipped", "3"]
    assert lines[-1] == "verdict: PASSED, every step ok or skipped as stated (300 s of 345 s)"
    incomplete = _write(tmp_path / "incomplete.tsv", "build\tok\t55\t\nnomps\tnot run\t0\twhy\n")
    process = _bash(f"print_summary '{incomplete}' 345 300")
    assert process.returncode == 1 and "verdict: INCOMPLETE, 1 step(s) not run" in process.stdout
    failed = _write(tmp_path / "failed.tsv",
                    "tests\tTIMED OUT\t150\tx\nsweep\tFAILED\t9\ty\nddp\tnot run\t0\tz\n")
    process = _bash(f"print_summary '{failed}' 345 300")
    assert process.returncode == 1
    assert process.stdout.splitlines()[-1].startswith(
        "verdict: FAILED, 2 step(s) failed or ran over, 1 not run")


def _fake_commands(folder, gpus: int) -> str:
    """A folder with an nvidia-smi that lists ``gpus`` H200s."""
    os.makedirs(folder, exist_ok=True)
    _write(os.path.join(folder, "nvidia-smi"), textwrap.dedent(f"""\
        #!/bin/bash
        case "$*" in
            -L) for (( i = 0; i < {gpus}; i++ )); do echo "GPU $i: NVIDIA H200"; done ;;
            *--query-gpu=index,*) echo "0, NVIDIA H200, 580.159.04, 143771 MiB, Default" ;;
            *--query-gpu=name*) echo "NVIDIA H200" ;;
        esac
        """))
    os.chmod(os.path.join(folder, "nvidia-smi"), 0o755)
    return str(folder)


def test_gpu_count_reads_nvidia_smi_narrowed_by_cuda_visible_devices(tmp_path):
    path = _fake_commands(tmp_path / "bin", 4) + os.pathsep + os.environ["PATH"]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PATH"] = path

    def run(extra: dict) -> str:
        return subprocess.run(["bash", "-c", f'source "{CHECK}"; gpu_count'],
                              capture_output=True, text=True, env=dict(env, **extra),
                              timeout=BASH_TIMEOUT).stdout.strip()

    assert run({}) == "4"
    assert run({"CUDA_VISIBLE_DEVICES": "1,3"}) == "2"
    assert run({"CUDA_VISIBLE_DEVICES": ""}) == "0"
    assert run({"PATH": "/nonexistent:" + "/usr/bin:/bin"}) == "0"


# --- processes ---------------------------------------------------------------------------------

SLEEPERS = textwrap.dedent("""\
    import subprocess, sys, time

    def rank_waiting_in_a_collective():
        time.sleep(600)

    def waiting_for_a_peer():
        time.sleep(600)

    if sys.argv[1:] == ["rank"]:
        rank_waiting_in_a_collective()
    child = subprocess.Popen([sys.executable, __file__, "rank"])
    print(child.pid, flush=True)
    waiting_for_a_peer()
    """)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(") ", 1)[1][0] == "Z"
    except FileNotFoundError:
        return True


def test_an_overrun_steps_stacks_are_dumped_and_its_processes_stopped(tmp_path):
    """Two interpreters, the second started by the first, both armed by the hook: the dump
    has both Python stacks (and C++ stacks where gdb is installed); stop_tree ends both."""
    hook, stacks = tmp_path / "hook", tmp_path / "stacks"
    stacks.mkdir()
    assert _bash(f"write_python_hook '{hook}'").returncode == 0
    script = _write(tmp_path / "sleepers.py", SLEEPERS)
    env = dict(os.environ, GPU_CHECK_STACKS=str(stacks),
               PYTHONPATH=os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH"))
                                          if p))
    parent = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + BASH_TIMEOUT
        while not os.path.exists(stacks / f"python-{child}.txt"):
            assert time.monotonic() < deadline, "the child interpreter was never armed"
            time.sleep(0.1)
        time.sleep(1)  # both are in their sleeping functions
        tree = _bash(f"process_tree {parent.pid}").stdout.split()
        assert tree == [str(parent.pid), str(child)]
        dump = tmp_path / "stacks.txt"
        process = _bash(f"dump_stacks tests {parent.pid} '{dump}'",
                        env={"GPU_CHECK_STACKS": str(stacks)}, timeout=RUN_TIMEOUT)
        assert process.returncode == 0, process.stderr
        text = dump.read_text()
        assert text.startswith("===== tests ran over its bound")
        assert f"--- pid {parent.pid}: {sys.executable} {script}" in text
        assert f"--- Python stacks of pid {child} (faulthandler)" in text
        assert 'in rank_waiting_in_a_collective' in text and 'in waiting_for_a_peer' in text
        if shutil.which("gdb") or shutil.which("cuda-gdb"):
            assert f"--- C++ stacks of pid {parent.pid}" in text
            assert "Thread 1 " in text or "#0 " in text, text[-2000:]
        else:
            assert "no C++ stacks" in text
        assert parent.poll() is None, "a stack dump must not end the process"
        assert _bash(f"stop_tree {parent.pid}").returncode == 0
        parent.wait(timeout=BASH_TIMEOUT)
        deadline = time.monotonic() + BASH_TIMEOUT
        while not _gone(child):
            assert time.monotonic() < deadline, "stop_tree left the child running"
            time.sleep(0.1)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


def test_the_hook_runs_the_sitecustomize_it_shadows(tmp_path):
    hook, other, stacks = tmp_path / "hook", tmp_path / "other", tmp_path / "stacks"
    other.mkdir()
    stacks.mkdir()
    _write(other / "sitecustomize.py", "import builtins\nbuiltins.shadowed_ran = True\n")
    assert _bash(f"write_python_hook '{hook}'").returncode == 0
    env = dict(os.environ, GPU_CHECK_STACKS=str(stacks),
               PYTHONPATH=os.pathsep.join([str(hook), str(other)]))
    out = subprocess.run(
        [sys.executable, "-c", "import builtins, os, signal, sys; "
         "print(getattr(builtins, 'shadowed_ran', False), os.getpid())"],
        capture_output=True, text=True, env=env, timeout=BASH_TIMEOUT).stdout.split()
    assert out[0] == "True"
    assert os.path.exists(stacks / f"python-{out[1]}.txt")
    # Without GPU_CHECK_STACKS the hook arms nothing, and SIGUSR1 keeps its usual meaning.
    env.pop("GPU_CHECK_STACKS")
    assert subprocess.run([sys.executable, "-c", "import faulthandler, signal, sys; "
                           "sys.exit(faulthandler.unregister(signal.SIGUSR1))"],
                          env=env, timeout=BASH_TIMEOUT).returncode == 0


# --- the whole script, with stand-ins ----------------------------------------------------------

FAKE_PYTHON = """\
#!/bin/bash
# Stands in for python in check.sh: canned output for each step, the real python otherwise.
fakes={fakes}
mps() {{ if [[ -f $fakes/daemon.pid ]] && kill -0 "$(< "$fakes/daemon.pid")" 2>/dev/null; then
    echo "mps daemon: running"; else echo "mps daemon: absent"; fi; }}
case "$*" in
    "-c import pytest_timeout") exit 0 ;;
    "-c import sys, torch;"*) echo "python 3.12.3 torch 2.11.0+cu130 cuda 13.0 gpus 1" ;;
    "setup.py build_ext --inplace") echo "built with PYDDP_BUILD_CUDA=$PYDDP_BUILD_CUDA" ;;
    "-m pytest -m cuda tests -k not torch "*)
        if [[ ${{FAKE_HANG:-}} == tests ]]; then exec {python} {fakes}/sleepers.py; fi
        mps; cat {fakes}/tests.txt ;;
    "-m pytest -m cuda tests -k torch "*) echo "=== 218 deselected in 4.17s ==="; exit 5 ;;
    "-m pyddp.bench --peers nccl,"*) mps; cat {fakes}/sweep.txt ;;
    "examples/train.py --device cuda --epochs 5") mps; cat {fakes}/train.txt ;;
    "-m pyddp.bench ddp --device cuda "*) mps; cat {fakes}/ddp.txt ;;
    "-m pytest -m cuda tests -k bitwise_identical "*) mps; cat {fakes}/nomps-tests.txt ;;
    "-m pyddp.bench --peers pyddp_ipc_two_shot,"*) mps; cat {fakes}/nomps-sweep.txt ;;
    *) exec {python} "$@" ;;
esac
"""

FAKE_MPS_CONTROL = """\
#!/bin/bash
# Stands in for nvidia-cuda-mps-control: -d starts a "daemon" (a sleep with its name),
# the commands on stdin ask for it or stop it.
fakes={fakes}
if [[ ${{1:-}} == -d ]]; then
    (exec -a nvidia-cuda-mps-control sleep 600) > /dev/null 2>&1 &
    echo $! > "$fakes/daemon.pid"
    echo "$CUDA_MPS_LOG_DIRECTORY" > "$fakes/log-directory"
    exit 0
fi
read -r command
case $command in
    get_server_list) [[ -f $fakes/daemon.pid ]] && kill -0 "$(< "$fakes/daemon.pid")" ;;
    quit) kill "$(< "$fakes/daemon.pid")" && rm -f "$fakes/daemon.pid" ;;
    *) exit 1 ;;
esac
"""


@pytest.fixture
def fakes(tmp_path):
    """A folder of stand-ins and canned outputs, and the environment that puts them first."""
    folder = tmp_path / "fakes"
    _fake_commands(folder, gpus=1)
    for name, template in (("python", FAKE_PYTHON), ("nvidia-cuda-mps-control",
                                                     FAKE_MPS_CONTROL)):
        _write(folder / name, template.format(fakes=folder, python=sys.executable))
        os.chmod(folder / name, 0o755)
    _write(folder / "sleepers.py", SLEEPERS)
    _write(folder / "tests.txt", PYTEST_CLOSED.replace("1 failed, ", ""))
    _write(folder / "sweep.txt", _sweep_output())
    _write(folder / "train.txt", _train_output(1, 97.5))
    _write(folder / "ddp.txt", _ddp_output(True))
    _write(folder / "nomps-tests.txt", "== 6 passed in 20.00s ==\n")
    _write(folder / "nomps-sweep.txt", _sweep_output().replace("gloo_cuda", "pyddp_ipc_one_shot"))
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "CUDA_VISIBLE_DEVICES")}
    env.update(PATH=f"{folder}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               TMPDIR=str(tmp_path))
    yield folder, env
    if (folder / "daemon.pid").exists():
        pid = int((folder / "daemon.pid").read_text())
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def _run_check(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", CHECK], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT, cwd="/")


def _steps(summary: str) -> dict[str, tuple[str, str]]:
    """The summary table's rows: step -> (verdict, numbers)."""
    lines = summary.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "verdict"])
    rows = {}
    for line in lines[header + 1:lines.index(next(l for l in lines if l.startswith("verdict: ")))]:
        name, rest = line[:12].strip(), line[13:]
        rows[name] = (rest[:10].strip(), rest[18:].strip())
    return rows


def _logs(out) -> dict[str, str]:
    with tarfile.open(out / "logs.tar.gz") as tar:
        return {os.path.basename(m.name): tar.extractfile(m).read().decode()
                for m in tar.getmembers() if m.isfile()}


def test_a_passing_check_with_mps_started_and_stopped_around_the_right_steps(fakes):
    folder, env = fakes
    process = _run_check(env)
    out = folder.parent / "out"
    summary = (out / "summary.txt").read_text()
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    assert process.stdout.rstrip().endswith(summary.rstrip())
    steps = _steps(summary)
    assert list(steps) == ["machine", "mps-start", "build", "tests", "torch", "sweep", "train",
                           "ddp", "mps-stop", "nomps-tests", "nomps-sweep"]
    assert {name: verdict for name, (verdict, _) in steps.items()} == dict(
        {name: "ok" for name in steps}, torch="skipped")
    assert steps["machine"][1] == "1 GPU(s): NVIDIA H200; 2 ranks"
    assert steps["tests"][1] == "197 passed, 0 failed, 20 skipped"
    assert steps["train"][1] == "final accuracy 97.50%; 2 ranks on 1 GPU(s)"
    assert steps["ddp"][1].startswith("overhead / torch DDP's 0.40x; bitwise identical: yes")
    assert "verdict: PASSED" in summary
    assert "# summary: all_reduce on cuda, speed-up over limit_cuda" in summary
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.txt", "sweep.log", "tests.log"]
    logs = _logs(out)
    assert "built with PYDDP_BUILD_CUDA=1" in logs["build.log"]
    for step in ("tests", "sweep", "train", "ddp"):
        assert "mps daemon: running" in logs[f"{step}.log"], step
    for step in ("nomps-tests", "nomps-sweep"):
        assert "mps daemon: absent" in logs[f"{step}.log"], step
    # The check stopped the daemon it started, which wrote its log among the check's.
    assert not (folder / "daemon.pid").exists()
    assert (folder / "log-directory").read_text().strip().endswith("/mps-log")


def test_a_daemon_that_was_running_is_left_alone_and_the_pass_without_mps_says_why(fakes):
    folder, env = fakes
    subprocess.run([str(folder / "nvidia-cuda-mps-control"), "-d"], env=env, check=True,
                   timeout=BASH_TIMEOUT)
    daemon = int((folder / "daemon.pid").read_text())
    process = _run_check(env)
    summary = (folder.parent / "out" / "summary.txt").read_text()
    assert process.returncode == 1
    steps = _steps(summary)
    assert steps["mps-start"] == ("skipped", f"a daemon was running already (pid {daemon}): "
                                             "left alone")
    assert "mps-stop" not in steps and "nomps-tests" not in steps
    assert steps["nomps"][0] == "not run"
    assert f"did not start was running (pid {daemon})" in steps["nomps"][1]
    assert "verdict: INCOMPLETE, 1 step(s) not run" in summary
    assert not _gone(daemon), "the check stopped a daemon it did not start"


def test_a_hanging_step_is_dumped_stopped_and_reported_within_the_cap(fakes):
    folder, env = fakes
    cap = 70
    started = time.monotonic()
    process = _run_check(dict(env, FAKE_HANG="tests", GPU_CHECK_SECONDS=str(cap)))
    took = time.monotonic() - started
    out = folder.parent / "out"
    summary = (out / "summary.txt").read_text()
    assert process.returncode == 1
    steps = _steps(summary)
    assert steps["tests"][0] == "TIMED OUT"
    assert steps["tests"][1].startswith("over ") and "stacks in stacks.txt" in steps["tests"][1]
    assert all(steps[name][0] == "not run" for name in ("torch", "sweep", "train", "ddp"))
    assert steps["mps-stop"][0] == "ok" and not (folder / "daemon.pid").exists()
    assert took < cap, f"the check took {took:.0f} s, over its cap of {cap} s"
    stacks = (out / "stacks.txt").read_text()
    assert "in waiting_for_a_peer" in stacks and "in rank_waiting_in_a_collective" in stacks
    pids = [int(line.split()[2].rstrip(":")) for line in stacks.splitlines()
            if line.startswith("--- pid ")]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "stacks.txt", "summary.txt", "tests.log"]
