"""Agentic SFT engines: Megatron-core (default) and DeepSpeed ZeRO-3 on the HF model."""

import warnings

from afm_core.utils import import_hooks

# megatron-core and mbridge warn at import when transformer-engine / apex are absent (every CPU machine) and about
# a cuda-graph default; both are expected here and would bury the progress bar, so they are silenced once.
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex) .*not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
import_hooks.install()  # before this package's modules first import megatron-core / mbridge
