"""MTP drafting: the drafter (`MTPDrafter`), its CUDA graphs (`MtpChainGraphs`) and its builder (`build_mtp`)."""

from .build import build_mtp
from .drafter import MTPDrafter
from .graphs import MtpChainGraphs

__all__ = ["MTPDrafter", "MtpChainGraphs", "build_mtp"]
