"""The job layer: per-rank functions run as submitit jobs on this machine or on Slurm.

Importing this package loads none of its modules (and so not submitit): import the one you need.

- :func:`afm_core.launch.submit.submit`: what ``jobs/*.py`` call; local or Slurm, waits or returns.
- :mod:`~afm_core.launch.executor`: a submitit executor from the ``cluster`` config group.
- :mod:`~afm_core.launch.distributed`: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_* from the scheduler.
- :mod:`~afm_core.launch.requeue`: checkpoint at the next step on USR2 / preemption / timeout, requeue, resume.
- :mod:`~afm_core.launch.sweep`: a Slurm multirun as one job array.
- :mod:`~afm_core.launch.records`: ``RUN_DIR/logs/job.json`` and ``events.jsonl``.
- :mod:`~afm_core.launch.follow`: stream rank 0's logs while waiting.
- :mod:`~afm_core.launch.teardown`: a stopped submitter (SIGTERM, Ctrl-C) stops its local job's processes.
- :mod:`~afm_core.launch.plan` (with ``plan_estimates``, ``plan_probe``, ``plan_render``, ``plan_gate``): the dry
  run of a job's memory and checkpoint cost, and the refusal before ``sbatch`` of one that does not fit.
"""
