"""afm: Agent Foundation Model training (Chain-of-Agents SFT and RL on Megatron-core, as Hydra + submitit jobs)."""

import afm_core.config  # noqa: F401  (registers the typed config schemas with Hydra's ConfigStore)
