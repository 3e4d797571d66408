"""Run the engine's processes at a lower CPU priority than the node, so the node's event loop keeps up with them.

Why: vLLM's front end reads the engine core's outputs in a task that does not yield to the event loop while
outputs are waiting (pyzmq hands back a message already received without suspending, and awaiting a finished
future does not suspend either). When the node's process gets less CPU than the engine core (a loaded host:
other tenants, or engines sharing cores), it falls behind, and that task then holds the loop until the engine
stops producing: seconds in which the node answers no RPC, sends no gossip heartbeat (peers start suspecting it)
and processes no cancellation. Seen here once with three CPU-bound processes beside a node on 2 cores: a
GetStatus went unanswered for the 9 s of a generation. The stall is intermittent (later runs of the same setup
did not show it, reniced or not), so this is a guard on a mechanism read in vLLM's code, not a measured speed-up.

The trade-off: on a contended host the engine, not the node, slows down. The node has to deliver everything the
engine produces anyway, and its gossip keeps the mesh's view of this node alive, so it goes first.

Nice values only matter when cores are contended, so an idle host serves at the same speed; with autogroup
scheduling they rank threads within one session, i.e. the node against its own engine, the comparison that
matters here. Linux keeps a nice value per thread, so every thread of every descendant process is reniced;
threads the engine starts later inherit it from their creator. Raising a nice value needs no privilege.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("p2pnode.engine")

#: The most a nice value can be on Linux.
MAX_NICE = 19


def descendant_pids(root: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process below ``root`` in the process tree (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")".
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop(0)
        for child in sorted(children.get(pid, ())):
            found.append(child)
            frontier.append(child)
    return found


def lower_priority(pids: list[int], increment: int, proc: Path = Path("/proc")) -> int:
    """Raise the nice value of every thread of ``pids`` by ``increment`` (capped at 19); returns threads changed."""
    changed = 0
    for pid in pids:
        try:
            tids = [int(t.name) for t in (proc / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                current = os.getpriority(os.PRIO_PROCESS, tid)
                target = min(MAX_NICE, current + increment)
                if target != current:
                    os.setpriority(os.PRIO_PROCESS, tid, target)
                    changed += 1
            except OSError:
                continue  # the thread exited, or this platform refuses: serving works either way
    return changed


def deprioritize_engine(increment: int) -> None:
    """Renice the processes the node started (vLLM's engine core and its workers) by ``increment``."""
    if increment <= 0 or not Path("/proc").is_dir():
        return
    pids = descendant_pids(os.getpid())
    threads = lower_priority(pids, increment)
    log.info("engine processes %s: %d threads reniced by +%d (--engine-nice)", pids, threads, increment)
