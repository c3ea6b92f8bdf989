"""docs/config-reference.md is what ``python -m afm_core.config.reference`` generates from the typed schemas and
conf/: a key added, removed or re-typed in a schema, or a changed default, fails here until it is regenerated."""

from __future__ import annotations

import difflib

from afm_core.config.reference import markdown
from afm_core.utils.paths import repo_root


def test_the_config_reference_lists_every_schema_key_as_generated():
    path = repo_root() / "docs" / "config-reference.md"
    generated = markdown()
    diff = "".join(
        difflib.unified_diff(path.read_text().splitlines(True), generated.splitlines(True), str(path), "generated")
    )
    assert not diff, f"{diff}\nregenerate: python -m afm_core.config.reference > docs/config-reference.md"
    for key in ("`trainer.max_steps`", "`logger`", "`profile.steps`", "`cluster.container_image (slurm)`"):
        assert key in generated
