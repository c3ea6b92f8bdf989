"""afm: Agent Foundation Model training (Chain-of-Agents SFT and RL on Megatron-core, as Hydra + submitit jobs).

Importing ``afm_core`` (or any of its modules) has no side effect beyond loading that module's own imports: the
typed config schemas are registered with Hydra by the job entry points (:func:`afm_core.config.register_schemas`),
and the package order the imports follow is in ``docs/architecture.md`` (enforced by ``tests/test_import_graph.py``).
"""
