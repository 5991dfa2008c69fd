"""Processes by /proc: a process's children, and whether a process seen earlier still runs (a pid is
known by its pid and start time, so a reused pid is not mistaken for it)."""

from __future__ import annotations

import os
from pathlib import Path

Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields after "pid (comm) "


def proc(pid: int) -> Proc | None:
    """The process ``pid`` now, None if there is none."""
    st = _stat(pid)
    return None if st is None else (pid, int(st[19]))


def children(pid: int) -> set[Proc]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None and int(st[1]) == pid:
            out.add((int(d), int(st[19])))
    return out


def descendants(pid: int) -> set[Proc]:
    found = children(pid)
    for p, _ in list(found):
        found |= descendants(p)
    return found


def cmdline(p: Proc) -> list[str]:
    try:
        return Path(f"/proc/{p[0]}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def service_names(p: Proc) -> set[str]:
    """A process's names for itself without ``radixserve.``: its command line's words (a service
    started with exec names its module there) and /proc's comm (a service the zygote forked has
    the zygote's command line, and the zygote named it by its module's last part)."""
    try:
        comm = Path(f"/proc/{p[0]}/comm").read_text().strip()
    except OSError:
        comm = ""
    return {x.removeprefix("radixserve.") for x in [*cmdline(p), comm]}


def running(p: Proc) -> bool:
    """Still there and not a zombie (a zombie has ended; only its exit status waits to be read)."""
    st = _stat(p[0])
    return st is not None and int(st[19]) == p[1] and st[0] != "Z"
