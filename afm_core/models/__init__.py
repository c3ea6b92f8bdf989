"""Model presets, the HF <-> Megatron bridge, the layer specs and attention, the fused cross-entropy."""

from afm_core.utils import import_hooks

import_hooks.install()  # before this package's modules first import megatron-core / mbridge
