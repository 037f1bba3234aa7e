"""A real vLLM-backed `inference` server for the `vllm` and `gpu` tests (CUDA or CPU build): started like `rl`
starts one, stopped with its process group; `SharedServer`, one such server that several modules use in turn; and a
plain JSON POST and GET to talk to them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def vllm_server(
    tmp_path: Path,
    model_dir: Path | str,
    seq_len: int,
    *extra: str,
    dtype: str = "float32",
    procs: list[subprocess.Popen] | None = None,
) -> Iterator[str]:
    """Yields the base URL of `inference --backend vllm` serving `model_dir` (a directory or a preset name;
    extra flags appended). `procs`, when given, receives the server process (its own process group: the proxy
    and vLLM), for tests that kill it."""
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "arbor.inference.server",
            "--backend",
            "vllm",
            "--port",
            "0",
            "--model.name",
            str(model_dir),
            "--seq-len",
            str(seq_len),
            "--ready-file",
            str(ready),
            "--vllm.enforce-eager",
            "true",
            "--vllm.gpu-memory-utilization",
            "0.3",
            "--vllm.dtype",
            dtype,
            *extra,
        ],
        start_new_session=True,
    )
    if procs is not None:
        procs.append(proc)
    try:
        deadline = time.monotonic() + 900
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "vLLM server did not start"
            time.sleep(1)
        yield ready.read_text().strip()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # a server stuck in shutdown must not outlive the tests
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SharedServer:
    """One `vllm_server` that tests of several modules share (a vLLM start costs ~50 s of a 2-core CI machine):
    started at the first `url()`, stopped by `stop()` (conftest stops it after the last test that uses it, so it
    never idles beside other modules' servers). Its weights are whatever the last user left: a module that needs
    the model's own weights loads them back (`restore`)."""

    def __init__(self, tmp_path: Path, model: str, seq_len: int) -> None:
        self.tmp_path, self.model, self.seq_len = tmp_path, model, seq_len
        self._server: contextlib.AbstractContextManager[str] | None = None
        self._url = ""

    def url(self) -> str:
        if self._server is None:
            server = vllm_server(self.tmp_path, self.model, self.seq_len)
            self._url = server.__enter__()
            self._server = server
        return self._url

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.__exit__(None, None, None)


def get_json(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def post_json(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())
