"""What one copy through Linux cross-memory attach costs on this machine.

Two processes, each with a plain (unregistered) tensor of half of each size: both
read the other's tensor into their own output at once with process_vm_readv (the
single copy Open MPI's shared-memory transport makes of a large message, "cma"),
and, for comparison, copy a tensor of their own of the same size (memcpy). Prints
the mean time of each per size (after two warm-up rounds) and checks the bytes read.

    python benchmarks/cma_read.py
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import time

import torch

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]  # bytes of an all_gather's output on 2 ranks
WARMUP = 2


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]


def _read(pid: int, dst: int, src: int, nbytes: int) -> None:
    local, remote = _IoVec(dst, nbytes), _IoVec(src, nbytes)
    got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got != nbytes:
        raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {nbytes} bytes")


def _rank(rank: int, mine, theirs, barrier, results) -> None:
    torch.set_num_threads(1)
    inputs = {s: torch.full((s // 8,), float(rank + 1)) for s in SIZES}
    mine.put((os.getpid(), {s: t.data_ptr() for s, t in inputs.items()}))
    pid, addresses = theirs.get(timeout=60)
    for size in SIZES:
        half = size // 2
        out, other = torch.empty(size // 8), torch.empty(size // 8)
        iterations = max(5, (256 << 20) // size)
        steps = {"process_vm_readv": lambda: _read(pid, out.data_ptr(), addresses[size], half),
                 "memcpy": lambda: other.copy_(inputs[size])}
        for name, step in steps.items():
            for _ in range(WARMUP):
                step()
            barrier.wait(60)
            start = time.perf_counter()
            for _ in range(iterations):
                step()
            seconds = (time.perf_counter() - start) / iterations
            barrier.wait(60)
            if rank == 0:
                results.put((size, name, seconds))
        assert out.eq(float(2 - rank)).all(), "process_vm_readv read the wrong bytes"


def main() -> None:
    ctx = mp.get_context("spawn")
    queues, results, barrier = [ctx.Queue(), ctx.Queue()], ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_rank, args=(r, queues[r], queues[1 - r], barrier, results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode is None:
            p.kill()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    print(f"{'size (B)':>10} {'read (B)':>10} {'step':>18} {'time (us)':>10} {'GB/s':>7}")
    while not results.empty():
        size, name, seconds = results.get()
        print(f"{size:>10} {size // 2:>10} {name:>18} {seconds * 1e6:>10.1f} "
              f"{size / 2 / seconds / 1e9:>7.2f}")


if __name__ == "__main__":
    main()
