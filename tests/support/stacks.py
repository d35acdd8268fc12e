"""What a process that hangs is doing, for a test's failure message: each thread's
name, state and kernel wait channel, and, where gdb is installed, each thread's
frames. Called before the test kills the process, so that a hang seen once (on a
loaded machine, say) says where it waited."""

from __future__ import annotations

import os
import shutil
import subprocess


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as error:
        return f"({error.strerror})"


def _where_in(pid: int, tid: str) -> str:
    """The library and offset of the thread's program counter in its system call (from
    /proc's syscall file: number, arguments, stack pointer, program counter), which says
    whose lock a futex wait is on even where gdb gives no frames."""
    fields = _read(f"/proc/{pid}/task/{tid}/syscall").split()
    if len(fields) < 3 or fields[0] in ("running", "-1"):
        return " ".join(fields)
    pc = int(fields[-1], 16)
    for line in _read(f"/proc/{pid}/maps").splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(a, 16) for a in parts[0].split("-"))
        if start <= pc < end:
            name = parts[5] if len(parts) > 5 else "(anonymous)"
            return f"system call {fields[0]} at {name}+{pc - start + int(parts[2], 16):#x}"
    return f"system call {fields[0]} at {pc:#x}"


def stacks_of(pid: int, timeout: float = 30.0) -> str:
    """A report of ``pid``'s threads; gdb, when present, is given ``timeout`` seconds."""
    lines = [f"process {pid}:"]
    tasks = f"/proc/{pid}/task"
    for tid in sorted(os.listdir(tasks) if os.path.isdir(tasks) else [], key=int):
        state = next((line for line in _read(f"{tasks}/{tid}/status").splitlines()
                      if line.startswith("State:")), "State: ?")
        lines.append(f"  thread {tid} {_read(f'{tasks}/{tid}/comm')!r} {state} "
                     f"waiting in {_read(f'{tasks}/{tid}/wchan') or '-'}, "
                     f"{_where_in(pid, tid)}")
    gdb = shutil.which("gdb")
    if gdb is None:
        lines.append("(no frames: gdb is not installed)")
        return "\n".join(lines)
    try:
        frames = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
                                capture_output=True, text=True, timeout=timeout).stdout
        lines += [line for line in frames.splitlines() if line.startswith(("Thread ", "#"))]
    except subprocess.TimeoutExpired:
        lines.append(f"(gdb gave no frames within {timeout} s)")
    return "\n".join(lines)
