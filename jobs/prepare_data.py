"""``python -m jobs.prepare_data``: prepare the CoA SFT data (a Hydra app, ``conf/prepare_data.yaml``).

Converts the real traces named in ``data.sources`` (or an alpaca JSON file, ``input.format=llamafactory
input.path=...``) to CoA trajectories, filters and splits them, and writes ``data.out_dir`` =
``{train.parquet, heldout.parquet, report.json}`` atomically; see :mod:`afm_core.data.prepare`. Does
nothing when ``out_dir`` already holds data prepared from the same config (``force=true`` redoes it).
``export=llamafactory`` / ``export=afm_rl`` also writes the result as LLaMA-Factory alpaca JSON or as
an AFM/verl RL parquet (:func:`afm_core.data.prepare.export_prepared`).

Examples::

    python -m jobs.prepare_data
    python -m jobs.prepare_data data.sources.gsm8k.limit=50 data.out_dir=/tmp/coa force=true
    python -m jobs.prepare_data input.format=llamafactory input.path=sft.json data.out_dir=/tmp/imported
    python -m jobs.prepare_data export=afm_rl export_dir=/tmp/rl
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import hydra
from omegaconf import DictConfig

from afm_core.config import ConfigError, check_config, register_schemas
from afm_core.config.data import PrepareDataConfig
from afm_core.data.prepare import PrepareInput, ensure_prepared, export_prepared, read_report

register_schemas()  # `- prepare_data_schema` in conf/prepare_data.yaml's defaults list: before @hydra.main composes


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare_data")
def main(cfg: DictConfig) -> None:
    try:
        config = check_config(cfg, PrepareDataConfig)
    except ConfigError as err:
        print(f"jobs.prepare_data: bad config: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    source = PrepareInput(format=config.input.format, path=config.input.path, task=config.input.task)
    out_dir = ensure_prepared(asdict(config.data), source=source, strict=config.strict, force=config.force)
    report = read_report(out_dir)
    assert report is not None, out_dir  # ensure_prepared wrote it
    summary = {"out_dir": str(out_dir), **{k: report[k] for k in ("sources", "filters", "split")}}
    if config.export:
        summary["export_dir"] = str(export_prepared(out_dir, config.export, config.export_dir))
    print(json.dumps(summary, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
