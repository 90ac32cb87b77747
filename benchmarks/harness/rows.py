"""Output: log lines and JSON rows (printed by rank 0 of a torchrun world), JSON files, the device line."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

# Rank 0 prints; the other ranks of a torchrun world run the same schedule silently.
RANK0 = os.environ.get("RANK", "0") == "0"


def say(text: str) -> None:
    """Print on rank 0 only."""
    if RANK0:
        print(text, flush=True)


def emit(row: dict) -> None:
    """One result row as a JSON line (floats rounded), printed by rank 0."""
    if not RANK0:
        return
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def write_json(path: str | None, payload: Any, indent: int | None = 1) -> None:
    """``payload`` as JSON at ``path`` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=indent)


def device_line(device: str | torch.device | None = None) -> str:
    """``device: <name>; torch <version>; triton <version>`` (the first line of a kernel benchmark's log)."""
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return f"device: {name}; torch {torch.__version__}; triton {triton_version}"
