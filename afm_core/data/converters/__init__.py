"""Converters from real agent traces to CoA trajectories, by source name.

=============  ================  ==========================================  ======  =========================================
name              default files (under the shared data dir)   task    steps produced
================  ==========================================  ======  =========================================
``gsm8k``         math/gsm8k/train.jsonl                      math    think / code (executed) / observation / answer
``fireact``       trajectories/fireact/{hotpotqa,multitask}   mhqa    think / wiki_search / observation / answer
``r1searcher``    trajectories/r1searcher/hotpotqa_qwen       mhqa    think / wiki_search / observation / answer
``tora``          trajectories/tora/examples.jsonl            math    think / code / observation / answer
``trajectories``  none: ``data.sources.trajectories.path``    any     as written: ``Trajectory.to_dict`` lines, e.g.
                                                                      ``jobs.distill``'s trajectories.jsonl
================  ==========================================  ======  =========================================

Each is a :class:`~afm_core.data.converters.base.Converter`: ``CONVERTERS[name](paths, limit=...,
strict=...)`` returns a :class:`~afm_core.data.converters.base.Conversion` (trajectories + report).
"""

from afm_core.data.converters.base import Conversion, ConversionReport, Converter, Rejected
from afm_core.data.converters.fireact import FIREACT
from afm_core.data.converters.gsm8k import GSM8K
from afm_core.data.converters.r1searcher import R1SEARCHER
from afm_core.data.converters.tora import TORA
from afm_core.data.converters.trajectories import TRAJECTORIES

CONVERTERS: dict[str, Converter] = {c.name: c for c in (GSM8K, FIREACT, R1SEARCHER, TORA, TRAJECTORIES)}

__all__ = ["CONVERTERS", "Conversion", "ConversionReport", "Converter", "Rejected"]
