"""The job layer: per-rank functions run as submitit jobs on this machine or on Slurm.

- :func:`submit` (``afm_core.launch.submit``): what ``jobs/*.py`` call; local or Slurm, waits or returns.
- :mod:`~afm_core.launch.executor`: a submitit executor from the ``cluster`` config group.
- :mod:`~afm_core.launch.distributed`: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from the scheduler.
- :mod:`~afm_core.launch.requeue`: checkpoint at the next step on USR2 / preemption / timeout, requeue, resume.
- :mod:`~afm_core.launch.sweep`: a Slurm multirun as one job array.
- :mod:`~afm_core.launch.records`: ``RUN_DIR/logs/job.json`` and ``events.jsonl``.
- :mod:`~afm_core.launch.follow`: stream rank 0's logs while waiting.
- :mod:`~afm_core.launch.teardown`: a stopped submitter (SIGTERM, Ctrl-C) stops its local job's processes.
"""

from afm_core.launch.submit import submit

__all__ = ["submit"]
