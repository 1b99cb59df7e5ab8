"""DFlash block drafting (Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036; vLLM's ``dflash`` method): one draft forward over the last
verified token plus mask tokens, attending to the target's hidden states, proposes a
whole block; checkpoints in the ``speculators`` ``dflash`` format."""

from specula.runtime.spec_decode.dflash.config import DFlashConfig
from specula.runtime.spec_decode.dflash.speculator import DFlashSpeculator

__all__ = ["DFlashConfig", "DFlashSpeculator"]
