"""Tests of pyddp._launch, the one launcher: real processes, every test bounded in time.

Most ranks are ``python -c`` commands, which start in a fraction of a second;
the function ranks import this module, and with it torch (seconds), so only
two tests spawn them. Every test checks that no process it started is left.
"""

import multiprocessing
import os
import signal
import sys
import textwrap
import time

import pytest

from paths import REPO
from pyddp import _launch
from pyddp._launch import RankFailed, RanksTimedOut, Rendezvous

PROMPT_SECONDS = 10.0
"""A failure or a kill must be dealt with in this long, far below the ranks' 60 s sleeps."""
SLEEP = "import time; time.sleep(60)"


@pytest.fixture
def short_abort(monkeypatch):
    """A shorter grace for the ranks a failure leaves behind, so that the tests stay quick."""
    monkeypatch.setattr(_launch, "ABORT_JOIN_SECONDS", 0.5)


def _gone(pid: int, within: float = 5.0) -> bool:
    """Whether ``pid`` has exited (or is a zombie that init has not yet reaped)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def _by_rank(*scripts: str) -> list:
    """A ``python -c`` command that runs ``scripts[RANK]``."""
    cases = "\n".join(f"if rank == {r}:\n{textwrap.indent(s, '    ')}"
                      for r, s in enumerate(scripts))
    return [sys.executable, "-c", f"import os, signal, sys, time\nrank = int(os.environ['RANK'])\n"
                                  f"{cases}\n"]


# --- function ranks ---------------------------------------------------------------------------

def _echo(rank: int, word: str, number: int) -> tuple:
    return rank, word, number, os.environ.get("PYDDP_TEST_LAUNCH")


def _raise_on_rank_1(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 says no")
    time.sleep(60)


@pytest.mark.multiprocess
def test_function_ranks_return_results_by_rank():
    with _launch.spawn(_echo, 2, ("word",), rank_args=lambda r: (10 * r,),
                       env=lambda r: {"PYDDP_TEST_LAUNCH": f"env{r}"}) as job:
        results = job.wait(_launch.STARTUP_SECONDS)
        pids = [job.pid(r) for r in range(2)]
    assert results == [(0, "word", 0, "env0"), (1, "word", 10, "env1")]
    assert job.exitcodes() == [0, 0]
    assert "PYDDP_TEST_LAUNCH" not in os.environ
    assert all(_gone(pid) for pid in pids)


def _report(rank: int, lines, stall_after: int) -> int:
    for k in range(3):
        lines.put(f"rank {rank} line {k}")
        if k == stall_after:
            time.sleep(60)
    return rank


@pytest.mark.multiprocess
def test_follow_shows_every_line_and_returns_the_results():
    lines = multiprocessing.get_context("spawn").Queue()
    shown = []
    try:
        with _launch.spawn(_report, 2, (lines, 99)) as job:
            assert job.follow(lines, 60, shown.append) == [0, 1]
    finally:
        lines.close()
    assert sorted(shown) == [f"rank {r} line {k}" for r in range(2) for k in range(3)]


@pytest.mark.multiprocess
def test_follow_stops_a_job_that_reports_nothing_for_too_long(short_abort):
    lines = multiprocessing.get_context("spawn").Queue()
    shown, pids = [], []
    try:
        # The rank would return after its sleep: only the stall ends the wait before.
        with pytest.raises(RanksTimedOut, match="no progress from the ranks for 2 s"):
            with _launch.spawn(_report, 1, (lines, 0)) as job:
                pids.append(job.pid(0))
                job.follow(lines, 2, shown.append)
    finally:
        lines.close()
    assert shown == ["rank 0 line 0"]
    assert _gone(pids[0])


@pytest.mark.multiprocess
def test_a_rank_that_raises_is_named_with_its_traceback(short_abort):
    job = _launch.spawn(_raise_on_rank_1, 2)
    pids = [job.pid(r) for r in range(2)]
    with pytest.raises(RankFailed) as failure:
        with job:
            job.wait(_launch.STARTUP_SECONDS)
    start = time.monotonic()
    assert failure.value.rank == 1
    assert str(failure.value).startswith("rank 1 failed:\nTraceback")
    assert "ValueError: rank 1 says no" in failure.value.traceback
    # Rank 1 may still be tearing its interpreter down when the grace ends.
    assert job.exitcodes()[0] == -signal.SIGKILL and job.exitcodes()[1] in (1, -signal.SIGKILL)
    assert all(_gone(pid) for pid in pids)
    assert time.monotonic() - start < PROMPT_SECONDS


# --- command ranks ----------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("ending, code, words", [
    ("sys.exit(3)", 3, "rank 1 exited with code 3"),
    ("os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL,
     "rank 1 was killed by SIGKILL"),
])
def test_a_rank_that_exits_is_named_and_the_others_are_stopped(tmp_path, short_abort, ending,
                                                              code, words):
    start = time.monotonic()
    job = _launch.start_commands(_by_rank(SLEEP, f"print('last words')\n{ending}"), 2,
                                 log_dir=str(tmp_path))
    pids = [job.pid(r) for r in range(2)]
    with pytest.raises(RankFailed) as failure:
        with job:
            job.wait(60)
    assert (failure.value.rank, failure.value.exitcode) == (1, code)
    assert str(failure.value).startswith(words), failure.value
    assert failure.value.log_tail == "last words"
    assert str(failure.value).endswith("its output ends:\nlast words")
    assert job.exitcodes() == [-signal.SIGKILL, code]
    assert all(_gone(pid) for pid in pids)
    assert time.monotonic() - start < PROMPT_SECONDS


@pytest.mark.multiprocess
def test_a_hung_rank_is_killed_after_the_timeout(short_abort):
    ignore_term = f"signal.signal(signal.SIGTERM, signal.SIG_IGN)\n{SLEEP}"
    start = time.monotonic()
    job = _launch.start_commands(_by_rank("pass", ignore_term), 2)
    pids = [job.pid(r) for r in range(2)]
    with pytest.raises(RanksTimedOut, match=r"rank 1 still running after 1 s"):
        with job:
            job.wait(1.0)
    assert job.exitcodes() == [0, -signal.SIGKILL]
    assert all(_gone(pid) for pid in pids)
    assert time.monotonic() - start < PROMPT_SECONDS


@pytest.mark.multiprocess
def test_each_rank_gets_its_environment_prefix_and_log(tmp_path):
    show = ("print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], "
            "os.environ['LOCAL_WORLD_SIZE'], os.environ['PYTHONPATH'].split(os.pathsep)[0], "
            "os.environ['PYDDP_TEST_LAUNCH'], os.environ['PYDDP_PREFIXED'])")
    command = [sys.executable, "-c", f"import os\n{show}"]
    with _launch.start_commands(command, 3, log_dir=str(tmp_path),
                                env=lambda r: {"PYDDP_TEST_LAUNCH": f"env{r}"},
                                prefix=lambda r: ["env", f"PYDDP_PREFIXED=prefix{r}"]) as job:
        assert job.wait(30) == [0, 0, 0]
    for rank in range(3):
        assert job.log_tail(rank) == f"{rank} 3 {rank} 3 {REPO} env{rank} prefix{rank}"


@pytest.mark.multiprocess
def test_simulated_hosts_have_their_names_and_private_shared_memory(tmp_path):
    reason = _launch.simulated_hosts_unavailable()
    if reason is not None:
        pytest.skip(f"simulated hosts: {reason}")
    name = f"pyddp-test-launch-{os.getpid()}"
    show = (f"open('/dev/shm/{name}-' + os.environ['RANK'], 'w').close()\n"
            "print(socket.gethostname(), os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'],"
            " os.environ['GLOO_SOCKET_IFNAME'])")
    hosts = _launch.SimulatedHosts(["a", "a", "b"], str(tmp_path))
    with hosts.start_commands([sys.executable, "-c", f"import os, socket\n{show}"],
                              log_dir=str(tmp_path)) as job:
        assert job.wait(30) == [0, 0, 0]
    assert [job.log_tail(rank) for rank in range(3)] == ["a 0 2 lo", "a 1 2 lo", "b 0 1 lo"]
    assert sorted(os.listdir(hosts.shm("a"))) == [f"{name}-0", f"{name}-1"]
    assert os.listdir(hosts.shm("b")) == [f"{name}-2"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(name)]


@pytest.mark.multiprocess
def test_a_rank_that_exits_before_it_reported_done_has_failed():
    with _launch.start_commands([sys.executable, "-c", "pass"], 2) as job:
        deadline = time.monotonic() + 30
        while job.exitcodes() != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RankFailed, match="^rank 1 exited with code 0 before finishing$"):
            job.poll(done={0})
        assert job.poll(done={0, 1})


@pytest.mark.multiprocess
def test_a_launcher_is_named_and_the_ranks_it_reported_are_killed(tmp_path, short_abort):
    pid_file = tmp_path / "pids"
    launcher = textwrap.dedent(f"""
        import subprocess, sys
        ranks = [subprocess.Popen([sys.executable, "-c", {SLEEP!r}]) for _ in range(2)]
        with open({str(pid_file)!r}, "w") as f:
            f.write(" ".join(str(p.pid) for p in ranks))
        print("started", flush=True)
        sys.exit(5)
    """)
    start = time.monotonic()
    job = _launch.start_launcher([sys.executable, "-c", launcher], 2, log_dir=str(tmp_path))
    with pytest.raises(RankFailed) as failure:
        with job:
            deadline = time.monotonic() + 30
            while not pid_file.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            pids = [int(p) for p in pid_file.read_text().split()]
            for rank, pid in enumerate(pids):
                job.adopt(rank, pid)
            assert job.pid(1) == pids[1]
            job.wait(30)
    name = os.path.basename(sys.executable)
    assert failure.value.rank is None and failure.value.exitcode == 5
    assert str(failure.value) == (f"{name} exited with code 5 before ranks [0, 1] finished; "
                                  "its output ends:\nstarted")
    assert (tmp_path / f"{name}.log").exists()
    assert all(_gone(pid) for pid in pids)
    assert time.monotonic() - start < PROMPT_SECONDS


def test_rendezvous_is_a_temporary_directory():
    with Rendezvous(prefix="pyddp-test-launch-") as rendezvous:
        directory = rendezvous.directory
        assert os.path.isdir(directory)
        assert os.path.basename(directory).startswith("pyddp-test-launch-")
        assert rendezvous.init_method() == "file://" + os.path.join(directory, "store")
        assert rendezvous.store_path("gloo") == os.path.join(directory, "gloo")
    assert not os.path.exists(directory)

