"""Start strop's services as local subprocesses (the demo and the end-to-end tests use this)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LocalService:
    name: str
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM (graceful drain), then SIGKILL if it does not exit in time.

        The default outlasts the services' own drain watchdog (2 × 30 s grace + 15 s), so a stuck drain
        shows up as exit status 1 with every thread's stack in the log rather than as a SIGKILL here.
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL: the service dies mid-whatever, as on a node failure."""
        self.process.kill()
        self.process.wait()


def start_service(
    name: str, args: list[str], workdir: Path, *, timeout: float = 180.0, env: dict[str, str] | None = None
) -> LocalService:
    """Run ``python -m strop.<name>_svc --address 127.0.0.1:0 …`` and wait until it reports its port."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        f"strop.{name}_svc",
        "--address",
        "127.0.0.1:0",
        "--port-file",
        str(port_file),
        *args,
    ]
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(
                f"{name} service exited with {proc.returncode}; see {log_path}:\n"
                + log_path.read_text()[-3000:]
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} service did not start within {timeout:.0f}s; see {log_path}")
        time.sleep(0.1)
    return LocalService(name, proc, int(port_file.read_text()), log_path)
