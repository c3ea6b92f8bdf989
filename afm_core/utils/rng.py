"""Keep library code out of the trainer's RNG.

The trainer seeds python's ``random`` and saves its state with every checkpoint, so a resumed run ends with the
uninterrupted run's state bit for bit. Some libraries the jobs call draw from that module-level generator a number
of times that depends on timing or on a fresh UUID, not on the run:

- aiohttp's connector shuffles the hosts that wait for a connection whenever one is released
  (``aiohttp/connector.py``, ``BaseConnector._release_waiter``);
- MLflow's file store makes an experiment id from ``uuid.uuid4()`` and pads each of its leading zeros with
  ``random.randint(0, 9)`` (``mlflow/utils/name_utils.py``, ``_generate_unique_integer_id``: about one
  experiment in ten), and its REST client adds ``random.random()`` jitter to retries.

Their calls run inside :func:`python_random_kept`.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def python_random_kept() -> Iterator[None]:
    """Python's ``random`` state is what it was on entry when the block ends (returns or raises)."""
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)
