"""Rendezvous through env://, tcp:// and file://, and under torchrun and the legacy launcher."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import pytest
import torch

import pyddp
from harness import RankContext, Ranks
from paths import SUPPORT
from pyddp.rendezvous import client_store

SCRIPT = os.path.join(SUPPORT, "launched_script.py")
LAUNCH_TIMEOUT = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_and_reduce(ctx: RankContext, init_method: str, explicit: bool) -> float:
    if explicit:
        pg = pyddp.new_group("shm", init_method=init_method, rank=ctx.rank,
                             world_size=ctx.world_size)
    else:
        os.environ["RANK"] = str(ctx.rank)
        pg = pyddp.new_group("shm", init_method=init_method)
    try:
        assert (pg.rank(), pg.size()) == (ctx.rank, ctx.world_size)
        t = torch.ones(5)
        pg.all_reduce(t)
        return t[0].item()
    finally:
        pg.shutdown()


@pytest.fixture(scope="module")
def env_ranks():
    port = _free_port()
    pool = Ranks(2, env={"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": str(port)})
    yield pool
    pool.close()


@pytest.mark.multiprocess
def test_env_init_method(env_ranks):
    assert env_ranks.run(_join_and_reduce, "env://", False) == [2.0, 2.0]


@pytest.mark.multiprocess
def test_tcp_init_method(env_ranks):
    url = f"tcp://127.0.0.1:{_free_port()}"
    assert env_ranks.run(_join_and_reduce, url, True) == [2.0, 2.0]


@pytest.mark.multiprocess
def test_file_init_method(env_ranks):
    url = "file://" + os.path.join(env_ranks.tmpdir, "file-init")
    assert env_ranks.run(_join_and_reduce, url, True) == [2.0, 2.0]


def test_init_methods_that_need_rank_and_world_size():
    with pytest.raises(ValueError, match="needs explicit rank and world_size"):
        pyddp.new_group("shm", init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="is not env://, tcp://host:port or file:///path"):
        pyddp.new_group("shm", init_method="redis://x")


def test_a_joining_process_reaches_the_jobs_store(tmp_path, monkeypatch):
    """pyddp.join's store: the job's FileStore, a client of its TCPStore (tcp:// and env://),
    and under torchrun (env://) the part of it that rendezvous() gives this attempt."""
    timeout = datetime.timedelta(seconds=10)
    path = str(tmp_path / "job")
    torch.distributed.FileStore(path, 2).set("k", b"file")
    assert client_store("file://" + path, timeout).get("k") == b"file"
    port = _free_port()
    served = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, timeout=timeout,
                                        wait_for_workers=False)
    served.set("k", b"tcp")
    assert client_store(f"tcp://127.0.0.1:{port}", timeout).get("k") == b"tcp"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    torch.distributed.PrefixStore("pyddp/attempt2", served).set("k", b"attempt 2")
    assert client_store("env://", timeout).get("k") == b"attempt 2"
    with pytest.raises(ValueError, match="names no store address"):
        monkeypatch.delenv("MASTER_ADDR")
        client_store("env://", timeout)


def test_local_rank_sources(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for argv, expected in [(["prog"], 0), (["prog", "--local_rank=3"], 3),
                           (["prog", "--local-rank", "2", "x"], 2), (["prog", "--local_rank", "1"], 1)]:
        monkeypatch.setattr(sys, "argv", argv)
        assert pyddp.local_rank() == expected
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert pyddp.local_rank() == 5


def _launch(args) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(pyddp.__file__)))] +
        os.environ.get("PYTHONPATH", "").split(os.pathsep)), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.multiprocess
def test_under_torchrun():
    out = _launch(["torch.distributed.run", "--nproc-per-node", "2",
                   f"--master-port={_free_port()}", SCRIPT])
    assert "rank 0/2 local_rank 0 sum 3" in out and "rank 1/2 local_rank 1 sum 3" in out, out


@pytest.mark.multiprocess
def test_under_legacy_launcher():
    out = _launch(["torch.distributed.launch", "--nproc-per-node", "2",
                   f"--master-port={_free_port()}", SCRIPT])
    assert "rank 0/2 local_rank 0 sum 3" in out and "rank 1/2 local_rank 1 sum 3" in out, out
