"""Start and stop an OpenAI-compatible vLLM server for tests and benchmarks, on the
loopback interface, by PID (its own process group, so its children go with it).

    with VllmServer(model_dir, env, ["--block-size", "16"]) as srv:
        srv.base_url  # http://127.0.0.1:PORT

`python -m vllm.entrypoints.openai.api_server` is used because the CPU build's
`vllm` console script fails (see docs/log/vllm.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    def __init__(self, model: str, env: dict, extra_args=(), *, name="smollm2",
                 log_path=None, start_timeout=420.0, python=sys.executable):
        self.model, self.env, self.extra = model, env, list(extra_args)
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.python = python
        self.proc = None
        self.started_s = None

    def start(self):
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--served-model-name", self.name, "--host", "127.0.0.1",
               "--port", str(self.port), *self.extra]
        self._log = (open(self.log_path, "w") if self.log_path  # noqa: SIM115 (closed in stop)
                     else subprocess.DEVNULL)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = t0 + self.start_timeout
        while time.perf_counter() < deadline:  # bounded wait for /health
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.proc.returncode} "
                                   f"(log: {self.log_path})")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.started_s = time.perf_counter() - t0
                        return self
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {self.start_timeout} s")

    def stop(self, timeout=30.0):
        """SIGTERM to the server's process group (its PID), SIGKILL after `timeout`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        finally:
            if self._log not in (None, subprocess.DEVNULL):
                self._log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
