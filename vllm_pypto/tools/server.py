"""Start and stop a real `vllm serve` process (used by the demo, the tests and the
benchmarks): free port, wait for /health, keep its log, stop it cleanly."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def console_script(name: str) -> str:
    """A console script (`vllm`, `lm_eval`) of this interpreter's environment, else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else (shutil.which(name) or name)


def vllm_command() -> str:
    return console_script("vllm")


class VllmServer:
    name, health_path = "vllm serve", "/health"  # a subclass serves another OpenAI server the same way

    def __init__(self, model: str, *args: str, port: int | None = None, env: dict | None = None,
                 startup_timeout: float = 600.0, progress=None):
        """progress(seconds, line): called while the server starts, with each new last line of its log."""
        self.model, self.args, self.port = model, list(args), port or free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})}
        # None removes a variable (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE wins over --kv-cache-memory-bytes)
        self.env = {k: v for k, v in env.items() if v is not None}
        self.startup_timeout, self.progress = startup_timeout, progress
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_lines(self, containing: str) -> list[str]:
        with open(self.log.name, errors="replace") as f:
            return [ln.rstrip("\n") for ln in f if containing in ln]

    def log_tail(self, n: int = 60) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def failure_report(self) -> str:
        """The log's first error (an engine core's root cause comes long before the API server's
        own traceback, which fills the tail), then the tail, and where the whole log is."""
        with open(self.log.name, errors="replace") as f:
            lines = f.readlines()
        first = next((i for i, ln in enumerate(lines) if "ERROR" in ln or "Traceback" in ln), len(lines))
        head = lines[first:first + 80] if first < len(lines) - 40 else []
        return "".join(head + (["[...]\n"] if head else []) + lines[-40:]) + f"(whole log: {self.log.name})"

    def command(self) -> list[str]:
        return [vllm_command(), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> "VllmServer":
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        t0 = time.time()
        deadline, shown = t0 + self.startup_timeout, ""
        while time.time() < deadline:
            if self.progress and (last := self.log_tail(1).strip()) and last != shown:
                self.progress(time.time() - t0, last)
                shown = last
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.failure_report()}")
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {self.startup_timeout:.0f}s:\n{self.failure_report()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.health_path, timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
