"""Other torch processes busy on this machine: they share its cores, so both run slower and timings mislead."""
from __future__ import annotations

import os
import time
from pathlib import Path


def busy_torch_processes(sample_s: float = 0.2, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """``(pid, command)`` of the other processes on this machine that have torch loaded and used more
    than a quarter of a core during a ``sample_s`` second sample (Linux: reads ``/proc``; elsewhere []).
    Both processes size their thread pools to all cores, so each slows the other many times over."""
    if not proc.is_dir():
        return []
    before = _cpu_ticks(proc)
    time.sleep(sample_s)
    after = _cpu_ticks(proc)
    threshold = 0.25 * sample_s * os.sysconf("SC_CLK_TCK")
    busy = [pid for pid, t in after.items() if pid != os.getpid() and t - before.get(pid, t) > threshold]
    return [(pid, _command(proc, pid)) for pid in busy if _has_torch(proc, pid)]


def busy_warning() -> str | None:
    """One warning line when another torch process is busy here (``JAKIRO_NO_BUSY_CHECK=1``: no check)."""
    if os.environ.get("JAKIRO_NO_BUSY_CHECK"):
        return None
    others = busy_torch_processes()
    if not others:
        return None
    pid, cmd = others[0]
    more = f" and {len(others) - 1} more" if len(others) > 1 else ""
    return (f"warning: another torch process is busy on this machine (pid {pid}: {cmd}{more}); both will run "
            f"slower and timings will be unreliable (their threads compete for {os.cpu_count()} cores)")


def process_ticks(stat: Path) -> int:
    """User + system CPU ticks so far of the process whose ``/proc/<pid>/stat`` is ``stat`` (its fields 14, 15)."""
    fields = _stat_fields(stat)
    return int(fields[11]) + int(fields[12])


def _stat_fields(stat: Path) -> list[str]:
    """The fields of a ``/proc/<pid>/stat`` after the command's name (which may hold spaces and parentheses): its
    state first, then the parent's pid, ..."""
    return stat.read_text().rsplit(")", 1)[1].split()


def family_ticks(pid: int | None = None, proc: Path = Path("/proc")) -> int:
    """User + system CPU ticks so far of process ``pid`` (None: this one), of the children it has waited for (a C++
    compiler run by inductor) and of every process it started that still runs, at any depth (a worker pool): its
    own load, not another process's."""
    pid = os.getpid() if pid is None else pid
    parent, ticks = {}, {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = _stat_fields(stat)
            n = int(stat.parent.name)
            parent[n], ticks[n] = int(fields[1]), sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            continue
    family, grown = {pid}, True
    while grown:
        more = {n for n, up in parent.items() if up in family} - family
        family |= more
        grown = bool(more)
    return sum(ticks.get(n, 0) for n in family)


def _cpu_ticks(proc: Path) -> dict[int, int]:
    """pid -> user + system CPU ticks so far."""
    out = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            out[int(stat.parent.name)] = process_ticks(stat)
        except (OSError, IndexError, ValueError):
            continue
    return out


def _has_torch(proc: Path, pid: int) -> bool:
    try:
        return b"libtorch" in (proc / str(pid) / "maps").read_bytes()
    except OSError:
        return False


def _command(proc: Path, pid: int, width: int = 80) -> str:
    try:
        cmd = " ".join((proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split())
    except OSError:
        cmd = "?"
    return cmd if len(cmd) <= width else cmd[:width - 3] + "..."
