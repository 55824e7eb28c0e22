"""Live servers for tests/serve: `python -m difflet_tpu.serve` in a subprocess on 127.0.0.1, a
port the OS picked, its stderr in a file; `Live.stop()` sends SIGTERM and waits (bounded)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pipelines"
START_TIMEOUT = 400  # load + warm-up compiles on two busy cores (seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFLET_TPU_", "XLA_FLAGS"))}
    e.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return e


class Live:
    def __init__(self, fixture: str, log: Path, *args, port: int | None = None, wait: bool = True, extra=()):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "difflet_tpu.serve", str(FIXTURES / fixture), "--port", str(self.port),
               "--dtype", "float32", *args]
        self.proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        self.extra = [subprocess.Popen([sys.executable, "-m", "difflet_tpu.serve", str(FIXTURES / fixture),
                                        "--dtype", "float32", *a], env=env(), stdout=subprocess.DEVNULL,
                                       stderr=open(f"{log}.{i + 1}", "w")) for i, a in enumerate(extra)]
        if wait:
            self.wait_ready()

    def stderr(self) -> str:
        return self.log.read_text()[-4000:]

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.stderr()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.stderr()}")

    def metric(self, name: str, **labels) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
            if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM to process 0 (the others stop when it tells them), then its exit status
        (killed after `timeout` s: then -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
            for p in self.extra:
                p.wait(timeout=timeout)
            return rc
        except subprocess.TimeoutExpired:
            self.kill()
            return -9

    def kill(self) -> None:
        for p in [self.proc, *self.extra]:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


@pytest.fixture(scope="session")
def live_server():
    """The `Live` class (tests import nothing from conftest under --import-mode=importlib)."""
    return Live
