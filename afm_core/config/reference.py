"""``docs/config-reference.md``, generated from the typed schemas: ``python -m afm_core.config.reference``.

For every app whose schema is registered (``<app>_schema`` in Hydra's ConfigStore, :func:`afm_core.config.
register_schemas`), one table of every key: its type (the schema's annotation), its default (``conf/<app>.yaml``
composed by Hydra, so recipes and groups are applied as a job sees them) and its meaning (the comment on that key's
line in the YAML file that sets it). ``cluster`` is listed for each of its schemas (``cluster=local`` /
``cluster=slurm``). ``tests/test_config_reference.py`` fails when the file and the schemas drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

from afm_core.utils.paths import repo_root

HEADER = """# Configuration reference

Generated from the typed schemas (`afm_core/config/`) and the defaults of `conf/` by
`python -m afm_core.config.reference > docs/config-reference.md`; `tests/test_config_reference.py` keeps it in
sync. Every key is checked before a job is built or submitted: a wrong type, an unknown key or a value out of
range exits with the key named. Override any key on the command line (`trainer.max_steps=50`); a list is
`logger=[console,tensorboard]`.
"""


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
    """``{dotted key: comment}`` for ``key: value  # comment`` lines of a block-style YAML file (the comment of a
    key's own line, or of the lines indented under it that hold only a comment)."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last = None
    for line in path.read_text().splitlines():
        match = re.match(r"^(\s*)([A-Za-z_][\w.-]*):(?:\s+([^#]*?))?\s*(?:#\s?(.*))?$", line)
        if not match:
            only = re.match(r"^\s+#\s?(.*)$", line)
            if only and last is not None and last in comments:
                comments[last] += " " + only.group(1).strip()
            continue
        indent, key, comment = len(match.group(1)), match.group(2), match.group(4)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = prefix + ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        last = dotted
        if comment:
            comments[dotted] = comment.strip()
    return comments


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "")


def _rows(schema: Any, values: Any, prefix: str, comments: dict[str, str]) -> list[tuple[str, str, str, str]]:
    rows = []
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        value = values.get(field.name) if isinstance(values, dict) else None
        nested = _schema_of(schema, field.name)
        if nested is not None and isinstance(value, dict):
            rows += _rows(nested, value, f"{key}.", comments)
            continue
        shown = json.dumps(value, default=str) if value is not None else "null"
        rows.append((key, _type_name(field.type), shown, comments.get(key, "")))
    return rows


def _schema_of(owner: Any, name: str) -> Any:
    """The dataclass of a nested field (annotations are strings under ``from __future__ import annotations``)."""
    import typing

    try:
        hint = typing.get_type_hints(owner).get(name)
    except Exception:  # an annotation that does not resolve: treat the field as a leaf
        return None
    return hint if dataclasses.is_dataclass(hint) else None


def _comments_for(app: str, cfg: Any) -> dict[str, str]:
    conf = repo_root() / "conf"
    comments = yaml_comments(conf / f"{app}.yaml")
    for group in ("model", "data", "parallel", "cluster", "engine", "tools"):
        values = cfg.get(group)  # the group's file: by its name (cluster, model), or the engine's backend
        chosen = (values.get("name") or values.get("backend")) if isinstance(values, dict) else None
        for path in [conf / group / f"{chosen}.yaml", conf / group / "default.yaml"]:
            if path.is_file():
                comments = {**yaml_comments(path, f"{group}."), **comments}
                break
    return comments


def app_tables() -> dict[str, list[tuple[str, str, str, str]]]:
    """``{app (and app with cluster=slurm): rows (key, type, default, meaning)}`` for every registered schema."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from afm_core.config import register_schemas
    from afm_core.config.cluster import CLUSTER_SCHEMAS

    register_schemas()
    tables = {}
    schemas = {name.removesuffix(".yaml"): node for name, node in ConfigStore.instance().repo.items()
               if isinstance(name, str) and name.endswith("_schema.yaml")}  # fmt: skip
    with initialize_config_dir(config_dir=str(repo_root() / "conf"), version_base="1.3"):
        for name in sorted(schemas):
            app = name.removesuffix("_schema")
            schema = OmegaConf.get_type(schemas[name].node)
            assert schema is not None and dataclasses.is_dataclass(schema)
            cfg = OmegaConf.to_container(compose(config_name=app, overrides=["+run_dir=RUN_DIR"] if app == "prepare_data" else ["run_dir=RUN_DIR"]), resolve=False)  # fmt: skip
            assert isinstance(cfg, dict)
            comments = _comments_for(app, cfg)
            rows = _rows(schema, cfg, "", comments)
            if "cluster" in {f.name for f in dataclasses.fields(schema)}:
                rows = [r for r in rows if not r[0].startswith("cluster")]
                for cluster, cluster_schema in CLUSTER_SCHEMAS.items():
                    composed = compose(config_name=app, overrides=["run_dir=RUN_DIR", f"cluster={cluster}"])
                    plain = OmegaConf.to_container(composed.cluster, resolve=False)
                    notes = yaml_comments(repo_root() / "conf" / "cluster" / f"{cluster}.yaml", "cluster.")
                    rows += [(f"{k} ({cluster})", t, d, m) for k, t, d, m in _rows(cluster_schema, plain, "cluster.", notes)]  # fmt: skip
            tables[app] = rows
    return tables


def markdown() -> str:
    parts = [HEADER]
    for app, rows in app_tables().items():
        parts.append(f"\n## `{app}` (`conf/{app}.yaml`, `python -m jobs.{app}`)\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        for key, kind, default, meaning in rows:
            cell = default if len(default) <= 60 else default[:57] + "..."
            key, kind, cell, meaning = (text.replace("|", "\\|") for text in (key, kind, cell, meaning))
            parts.append(f"| `{key}` | `{kind}` | `{cell}` | {meaning} |")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
