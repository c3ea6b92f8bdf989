"""Requests to checkpoint (and stop) at the next step boundary: set by the scheduler's signal, read by the loops.

A :class:`Preemption` is handed to each loop that can be asked to stop (the SFT loop
:class:`~afm_core.train.loop.SFTLoop`, the RL driver :func:`afm_core.rl.driver.run_rl` and its rollout actor). A
job's ranks use :data:`JOB_PREEMPTION`, the one the job's SIGUSR2 reaches: ``launch.requeue`` relays the signal
(Slurm's ``--signal=USR2@...`` before the time limit, a preemption) to the job's ``on_preempt`` hook,
:func:`request_checkpoint`. Loops built elsewhere (tests, benchmarks) get a :class:`Preemption` of their own, so no
process-wide flag needs resetting between them. The pattern is Megatron-LM's ``DistributedSignalHandler``
(``megatron/training/dist_signal_handler.py``): a flag set in the handler, all-reduced over the ranks at each step
boundary so that they save and stop together.
"""

from __future__ import annotations


class Preemption:
    """This process's pending requests: checkpoint at the next step boundary, and then stop or not.

    :meth:`request` only sets attributes, so it is safe in a signal handler. :meth:`boundary_flags` is the
    collective every loop calls at each step boundary; :meth:`stop_requested` is what a phase that can be abandoned
    (an RL generation round, a validation) polls between its awaits.
    """

    def __init__(self) -> None:
        self._checkpoint = False
        self._stop = False

    def request(self, stop: bool = True) -> None:
        """Ask for a checkpoint at the next step boundary (and then a stop if ``stop``); signal-safe."""
        self._checkpoint = True
        self._stop = self._stop or stop

    def stop_requested(self) -> bool:
        """Whether a stop was asked for, without clearing it (the step boundary, :meth:`boundary_flags`, clears it)."""
        return self._stop

    def boundary_flags(self, on_gpu: bool) -> tuple[bool, bool]:
        """``(checkpoint requested, stop requested)`` OR-ed over all ranks of the default process group: the
        requeue check every training loop (SFT's and RL's) makes at each step boundary (a collective: every rank
        calls it; ``on_gpu``: the all-reduce runs on the current CUDA device, as NCCL needs).

        A flag is cleared only if it was read as set, before the all-reduce: a signal that lands during the
        collective (or between the read and the clear) stays set for the next boundary instead of being lost.
        """
        import torch  # here: the job entry points import this module to check a config before the queue

        checkpoint, stop = self._checkpoint, self._stop
        if checkpoint:
            self._checkpoint = False
        if stop:
            self._stop = False
        flags = torch.tensor([int(checkpoint), int(stop)], device="cuda" if on_gpu else "cpu")
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])


#: The requests of the job this process runs a rank of: what its SIGUSR2 sets (through :func:`request_checkpoint`)
#: and what ``run_sft`` and ``run_rl`` hand their loops when they are given none.
JOB_PREEMPTION = Preemption()


def request_checkpoint(stop: bool = True) -> None:
    """The job's preemption hook (``on_preempt`` of ``jobs.sft`` and ``jobs.rl``): :meth:`Preemption.request` on
    :data:`JOB_PREEMPTION`. Safe to call from a signal handler."""
    JOB_PREEMPTION.request(stop)
