"""A server process that never outlives its owner: started in a process group of its own, watched while it starts,
and ended with its whole group (SIGTERM, then SIGKILL) on every path - a normal exit, a timeout, the server's own
death, Ctrl-C or SIGTERM to the caller. SGLang's launcher spawns its scheduler and detokenizer; they stay in the
group, so ending the group frees their GPU memory and the port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping, Sequence


class Terminated(KeyboardInterrupt):
    """SIGTERM to this process, raised where Ctrl-C would raise KeyboardInterrupt (`sigterm_as_interrupt`)."""


class ServerError(RuntimeError):
    """The server died or did not become ready; `log_tail` is the end of its log."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex((host, port)) == 0


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (zombies of our own children excepted once reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ServerProcess:
    """`argv` run in its own session with stdout and stderr to `log_path`; ready when GET `ready_path` answers 200.

    Use as a context manager: leaving the block ends the group whatever raised."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        ready_path: str = "/model_info",
    ):
        self.argv, self.port, self.host, self.ready_path = list(argv), port, host, ready_path
        self.log_path, self.env = Path(log_path), dict(env) if env is not None else None
        self.proc: subprocess.Popen | None = None
        self.pgid: int | None = None
        self.started_at: float | None = None
        self.ready_after: float | None = None  # seconds from start to the first 200
        self.stopped: dict | None = None  # what stop() found and did

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        if port_in_use(self.port, self.host):
            raise ServerError(f"port {self.port} on {self.host} is in use before the server started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        finally:
            log.close()  # the child holds its own descriptor
        self.pgid = self.proc.pid  # a new session's leader: its pid is the group's id
        self.started_at = time.monotonic()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float, on_tick: Callable[[float], None] | None = None) -> float:
        """Block until the server answers `ready_path` with 200; seconds it took. ServerError when the process
        exits first or `timeout` passes (the caller's `with` block then ends the group)."""
        assert self.proc is not None and self.started_at is not None, "start() first"
        deadline = self.started_at + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(f"the server exited with code {code} before it was ready", self.log_tail())
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        self.ready_after = time.monotonic() - self.started_at
                        return self.ready_after
            except (urllib.error.URLError, OSError, ValueError):
                pass
            now = time.monotonic()
            if now > deadline:
                raise ServerError(f"the server was not ready after {timeout:.0f} s", self.log_tail())
            if on_tick is not None:
                on_tick(now - self.started_at)
            time.sleep(1.0)

    def stop(self, grace: float = 20.0) -> dict:
        """End the whole group: SIGTERM, up to `grace` seconds, then SIGKILL. Returns what was left and done.
        Ctrl-C and SIGTERM wait until it is done (a second signal must not cut the clean-up short)."""
        if self.stopped is not None:  # once: a second call reports the first
            return self.stopped
        if self.proc is None or self.pgid is None:
            return {"stopped": False}
        if threading.current_thread() is not threading.main_thread():  # (handlers are the main thread's)
            return self._stop(grace)
        came: list[int] = []
        previous = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._stop(grace)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if came:  # a signal that came meanwhile lands now, as it would have
                signal.raise_signal(came[0])

    def _stop(self, grace: float) -> dict:
        done = {"stopped": True, "sigkill": False, "exit_code": self.proc.poll()}
        if group_alive(self.pgid):
            try:
                os.killpg(self.pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader so it does not count as alive
                if not group_alive(self.pgid):
                    break
                time.sleep(0.2)
            else:
                done["sigkill"] = True
                try:
                    os.killpg(self.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while group_alive(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        done["exit_code"] = self.proc.returncode
        done["group_left"] = group_alive(self.pgid)
        done["port_free"] = not port_in_use(self.port, self.host)
        self.stopped = done
        return done

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM to this process raises KeyboardInterrupt, so `with ServerProcess(...)` blocks
    clean up as they do on Ctrl-C (as `Terminated`, a KeyboardInterrupt; only in the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
