"""llama.cpp's ``llama-server`` as a peer for ``python -m bench.serve --llama-server GGUF``:
started on a free 127.0.0.1 port, waited for until its ``/health`` answers 200, stopped
at the end (terminate, then kill after a grace period).

It runs one thread (``-t 1 -tb 1``, as ``bench.llamacpp`` runs llama.cpp) with ``SLOTS``
parallel sequences and continuous batching, and a context of ``SLOTS * slot_ctx`` tokens:
llama-server divides its context evenly among its slots, so each request gets
``slot_ctx``. The binary is built by ``python -m bench.llamacpp --build-server``.
"""
from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.serve_client import ServeError

BUILD_COMMAND = "python -m bench.llamacpp --build-server"


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(binary: Path, gguf: Path, port: int, slots: int, slot_ctx: int) -> list[str]:
    """llama-server's command line: one thread, ``slots`` sequences batched continuously."""
    return [str(binary), "-m", str(gguf), "-t", "1", "-tb", "1", "-np", str(slots), "--cont-batching",
            "-c", str(slots * slot_ctx), "--host", "127.0.0.1", "--port", str(port)]


def wait_ready(health_url: str, alive, timeout_s: float, poll_s: float = 0.25, log_tail=lambda: "") -> float:
    """Poll ``health_url`` until it answers 200 (llama-server answers 503 while it loads the
    model); the seconds it took. ``alive()`` False (the process exited) or ``timeout_s``
    passing is a ``ServeError`` with the log's tail. Bounded: at most ``timeout_s / poll_s``
    polls, each with a short timeout of its own."""
    import httpx
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if not alive():
            raise ServeError(f"llama-server exited before it was ready; its log ends: {log_tail()!r}")
        try:
            if httpx.get(health_url, timeout=min(2.0, timeout_s)).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(poll_s)
    raise ServeError(f"llama-server was not ready after {timeout_s:g} s ({health_url}); its log ends: "
                     f"{log_tail()!r}")


def stop(process: subprocess.Popen, grace_s: float = 10.0) -> int:
    """Terminate ``process`` (SIGTERM: llama-server finishes its slots and exits), kill it if
    it is still running after ``grace_s``; its exit status."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(grace_s)
    return process.returncode


@dataclass
class LlamaServer:
    """A context manager: ``with LlamaServer(gguf) as server: server.base_url``."""

    gguf: Path
    slots: int = 8
    slot_ctx: int = 2048
    start_timeout_s: float = 300.0
    binary: Path | None = None  # default: bench.llamacpp's build of llama-server
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "LlamaServer":
        binary = self.binary or default_binary()
        if not binary.is_file():
            raise ServeError(f"llama-server is not built ({binary} missing): run {BUILD_COMMAND}")
        if not Path(self.gguf).is_file():
            raise ServeError(f"--llama-server: no GGUF file at {self.gguf}")
        self.port = free_port()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")
        self.process = subprocess.Popen(server_command(binary, Path(self.gguf), self.port, self.slots, self.slot_ctx),
                                        stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_ready(f"http://127.0.0.1:{self.port}/health", lambda: self.process.poll() is None,
                       self.start_timeout_s, log_tail=self.log_tail)
        except BaseException:  # Ctrl-C while it loads too: never leave it running
            self.__exit__(None, None, None)
            raise
        return self

    def log_tail(self, chars: int = 400) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None
        self._log.close()


def default_binary() -> Path:
    from bench.llamacpp import SERVER, binary
    return binary(SERVER)
