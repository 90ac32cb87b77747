"""Weight quantisation: block-FP8 tiles (`fp8`).

Importing this package needs only torch.
"""

from __future__ import annotations

from .fp8 import FP8_MAX, block_scale_shape, dequantize_block_fp8, expand_blocks, quantize_block_fp8

__all__ = ["FP8_MAX", "block_scale_shape", "dequantize_block_fp8", "expand_blocks", "quantize_block_fp8"]
