"""A code-execution server for the ``<code>`` tool: untrusted Python snippets in jails, over HTTP.

- :mod:`sandbox.jail`: the jail's command line (bubblewrap by default, nsjail when ``nsjail_path`` is set):
  no network, read-only minimal root, private ``/tmp``, own pid namespace, no capabilities, rlimits.
- :mod:`sandbox.runner`: runs snippets as asyncio subprocesses with bounded concurrency, a bounded queue,
  capped output and a wall-clock kill.
- :mod:`sandbox.server`: ``python -m sandbox.server --host 127.0.0.1 --port N`` (``POST /run``, ``GET /health``).
"""
