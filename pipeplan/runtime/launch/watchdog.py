"""Heartbeats through the TCPStore so that no rank hangs when another dies or freezes.

Every rank's watchdog thread bumps its own counter in the store about once a second and watches the next few ranks
on a ring (so the store serves O(world size) reads per second, not O(world size^2)). A watched peer whose counter has
not moved for `timeout_s` (by this rank's own clock, so node clocks need not agree) is published as the failure;
every watchdog polls that one key and, once set, prints one line naming the failed rank and exits non-zero. A frozen
peer on the same host is killed by the watchdog that noticed it, so the launcher need not wait for it to exit. A rank
that finished marks itself done. Process-group timeouts catch the remaining cases (a rank alive but stuck outside
Python, or a dead rank whose watchers died with it).

Under the local launcher each rank also leaves its pid, a heartbeat file it touches at every beat and, once finished,
a done file in the launcher's folder (ERROR_DIR_ENV); the launcher's `ExitWatch` kills a rank whose process is still
there `timeout_s` after its last beat or its done mark (stopped or frozen after its peers left, even after the
summary), so that the launcher always returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from pipeplan.errors import DEBUG_ENV

PREFIX = "pipeplan/heartbeat/"
PID_PREFIX = "pipeplan/pid/"  # host:pid of each rank, so a watchdog can end a frozen peer on its own host
FAILED_KEY = "pipeplan/failed"
DONE = b"done"
EXIT_CODE = 17
WATCHED_PEERS = 4
GRACE_S = 2.0  # the launcher's ExitWatch waits this much longer than the peers, who name a stopped rank themselves
ERROR_DIR_ENV = "PIPEPLAN_ERROR_DIR"  # the local launcher collects each failed rank's one-line message here


def record_error(rank: int, message: str, trace: str | None = None) -> None:
    """A rank's one-line error (and, under PIPEPLAN_DEBUG=1, its traceback `trace`): left for the local launcher,
    which prints one line for the whole run (launch.py), or printed here when no launcher collects it (torchrun)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    trace = trace if os.environ.get(DEBUG_ENV) else None
    if folder:
        if trace:
            Path(folder, f"rank_{rank}.traceback").write_text(trace)
        Path(folder, f"rank_{rank}.txt").write_text(message + "\n")
        return
    if trace:
        print(f"pipeplan rank {rank}: {trace}", file=sys.stderr, end="", flush=True)
    print(f"pipeplan rank {rank}: error: {message}", file=sys.stderr, flush=True)


def _mark(rank: int, kind: str, text: str | None = None) -> None:
    """Leave `rank_N.KIND` in the launcher's folder (written, or its time updated); nothing under torchrun."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return
    path = Path(folder, f"rank_{rank}.{kind}")
    with contextlib.suppress(OSError):  # the launcher cleaning up its folder at the very end
        if text is not None:
            path.write_text(text)
        else:
            path.touch()


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting for its parent has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class ExitWatch:
    """The local launcher's watch over its ranks' exits (module docstring): a rank whose process is still there
    `timeout_s` after its last sign of life (a beat, or its done mark) is killed and its error recorded."""

    def __init__(self, folder: str | os.PathLike, timeout_s: float) -> None:
        self.folder, self.timeout_s = Path(folder), timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pipeplan-exit-watch", daemon=True)

    def __enter__(self) -> ExitWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(min(0.5, self.timeout_s / 4)):
            for pid_file in self.folder.glob("rank_*.pid"):
                with contextlib.suppress(OSError, ValueError):
                    self._check(int(pid_file.stem.removeprefix("rank_")), int(pid_file.read_text()))

    def _check(self, rank: int, pid: int) -> None:
        marks = [self.folder / f"rank_{rank}.{kind}" for kind in ("pid", "beat", "done")]
        last = max(path.stat().st_mtime for path in marks if path.exists())
        if time.time() - last <= self.timeout_s + GRACE_S or not _alive(pid):
            return
        done = marks[2].exists()
        os.kill(pid, signal.SIGKILL)
        if not (self.folder / f"rank_{rank}.txt").exists():
            when = " after it finished" if done else ""
            (self.folder / f"rank_{rank}.txt").write_text(
                f"stopped or frozen{when} (no sign of life for {self.timeout_s:.0f} s, --heartbeat-timeout); the "
                "launcher killed it\n"
            )


def _connect(timeout_s: float) -> dist.Store:
    """Our own client of the launcher's store (the process group's client is not shared with this thread)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=max(timeout_s, 5.0)))
    return dist.distributed_c10d._get_default_store()  # e.g. a file:// init; shared with the process group


class Watchdog:
    def __init__(self, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 10)
        self._store = _connect(timeout_s)
        self._stop = threading.Event()
        self._beat = 0
        self._thread = threading.Thread(target=self._loop, name="pipeplan-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._store.set(f"{PREFIX}{self.rank}", "0")
        self._store.set(f"{PID_PREFIX}{self.rank}", f"{socket.gethostname()}:{os.getpid()}")
        _mark(self.rank, "pid", str(os.getpid()))
        self._thread.start()
        return self

    def stop(self, *, done: bool = True) -> None:
        """Stop beating; `done` tells the peers this rank finished (not died)."""
        self._stop.set()
        self._thread.join(timeout=5)
        if done:
            _mark(self.rank, "done")
            with contextlib.suppress(Exception):  # the store may already be gone at the very end of a run
                self._store.set(f"{PREFIX}{self.rank}", DONE.decode())

    def freeze(self) -> None:
        """Fault injection: stop beating without saying goodbye (a frozen process)."""
        self._stop.set()

    def report_failure(self, message: str) -> None:
        with contextlib.suppress(Exception):
            self._store.set(FAILED_KEY, f"rank {self.rank}: {message}")

    def _loop(self) -> None:
        count = min(WATCHED_PEERS, self.world_size - 1)
        peers = [(self.rank + step) % self.world_size for step in range(1, count + 1)]
        keys = [f"{PREFIX}{r}" for r in peers]
        last_value: dict[int, bytes] = {}
        last_change = dict.fromkeys(peers, time.monotonic())
        while not self._stop.wait(self.interval_s):
            try:
                self._beat += 1
                self._store.set(f"{PREFIX}{self.rank}", str(self._beat))
                _mark(self.rank, "beat")
                values = self._store.multi_get(keys) if keys else []
                failed = self._store.check([FAILED_KEY]) and self._store.get(FAILED_KEY).decode()
            except Exception as exc:  # the store (on the launcher or rank 0) is gone
                if self._stop.is_set():
                    return
                self._exit(f"lost the rendezvous store ({type(exc).__name__}); the launcher or rank 0 is gone")
                return
            if failed and not self._stop.is_set():
                self._exit(failed, publish=False)
            now = time.monotonic()
            for peer, value in zip(peers, values, strict=True):
                if value == DONE:
                    last_change[peer] = float("inf")
                elif value != last_value.get(peer):
                    last_value[peer], last_change[peer] = value, now
                elif now - last_change[peer] > self.timeout_s and not self._stop.is_set():
                    self._kill_if_local(peer)
                    self._exit(f"rank {peer} stopped responding (no heartbeat for {self.timeout_s:.0f} s)")

    def _kill_if_local(self, peer: int) -> None:
        """A frozen or stopped (SIGSTOP) rank on this host cannot act on the launcher's SIGTERM, which would then
        wait before its SIGKILL: end it now so that every rank is gone right after the timeout."""
        with contextlib.suppress(Exception):
            host, pid = self._store.get(f"{PID_PREFIX}{peer}").decode().rsplit(":", 1)
            if host == socket.gethostname() and int(pid) != os.getpid():
                os.kill(int(pid), signal.SIGKILL)

    def _exit(self, reason: str, *, publish: bool = True) -> None:
        if publish:
            self.report_failure(reason)
        record_error(self.rank, reason)
        os._exit(EXIT_CODE)
