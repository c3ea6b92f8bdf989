"""Rank processes for tests: ``torch.multiprocessing.start_processes`` forked from a forkserver that has imported
torch, megatron.core and transformers once.

A ``spawn``-ed rank is a fresh interpreter that imports those itself: ~10 s of CPU on two quiet cores (``python -X
importtime -c "import megatron.core"``: megatron.core alone ~5 s, most of it torch._inductor, torch._dynamo and wandb,
which it imports at module level; about half as much CPU after :mod:`afm_core.utils.import_hooks`), and the suite starts
a few hundred ranks. A forkserver imports them once per pytest worker (``multiprocessing.set_forkserver_preload``) and
forks each rank from that state, which copies nothing until written. The ranks are still fresh processes as far as the
code under test goes: the server only imported modules (no process group, no parallel state, no tensors), started before
any test changes the environment (:func:`start_forkserver`, from tests/conftest.py), and each rank takes its caller's
current environment, working directory, stdout and stderr before it runs (:func:`_in_callers_env`), as a spawned one
would: its output lands in the test's captured output, not in the forkserver's terminal.

Production code launches its ranks through submitit, Slurm or ``torchrun``; this is test plumbing only.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Callable, Sequence
from typing import Any

#: What the forkserver imports before it forks the first rank: third-party packages (the code under test is imported
#: by each rank, from the tree being tested), after ``afm_core.engine``'s package init alone, which installs
#: :mod:`afm_core.utils.import_hooks` so that megatron.core is imported as a production rank imports it. vLLM's
#: in-process engine and its CPU worker too: ~9 s a rank on two AVX2 cores (the import ~7.6 s after the others, the
#: worker's modules ~1.3 s more when the engine starts), paid by every RL rank with an in-process engine. Importing
#: vLLM starts no thread and leaves torch's settings alone; the variables it sets in ``os.environ`` (inductor's cache
#: dir and compile threads, e.g.) are not a rank's: :func:`_in_callers_env` replaces the environment with the caller's.
#: A module that does not import (vLLM's CPU worker on a CUDA build) is skipped by the forkserver.
PRELOAD = ("afm_core.engine", "torch", "megatron.core", "transformers", "vllm.entrypoints.llm",
           "vllm.v1.engine.async_llm", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner")  # fmt: skip


def start_forkserver() -> None:
    """Start this process's forkserver with :data:`PRELOAD` imported (a no-op if it runs already). Called once per
    pytest worker at session start, so that the server's imports overlap with the first tests and its environment
    is the session's, not one a test set."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()


def start_ranks(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True) -> Any:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the forkserver, as
    ``torch.multiprocessing.start_processes`` (``join=True``: wait for all, and raise
    ``torch.multiprocessing.ProcessRaisedException`` with the rank's traceback if one fails; ``join=False``: the
    ``ProcessContext``). ``fn`` must be importable by name (a module-level function)."""
    import torch.multiprocessing as mp

    start_forkserver()
    context_args = (fn, dict(os.environ), os.getcwd(), _Fd(1), _Fd(2), tuple(args))
    return mp.start_processes(_in_callers_env, args=context_args, nprocs=nprocs, join=join, start_method="forkserver")


class _Fd:
    """A file descriptor of the caller that a forkserver child receives as its own: pickled as
    ``multiprocessing.reduction.DupFd``, which sends it along with the fork request (``popen_forkserver``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        import multiprocessing.reduction

        return _received_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _in_callers_env(rank: int, fn: Callable[..., Any], env: dict[str, str], cwd: str, stdout: int, stderr: int,
                    args: tuple) -> None:  # fmt: skip
    """In the rank: the caller's environment, directory, stdout and stderr at :func:`start_ranks` (a forked rank
    would otherwise have the forkserver's), then ``fn(rank, *args)``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    fn(rank, *args)
