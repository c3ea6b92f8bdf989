"""Distillation tests reuse the tool tests' fixtures: the real data folder and real tool servers."""

from tests.tools.conftest import data_dir  # noqa: F401 - a pytest fixture
