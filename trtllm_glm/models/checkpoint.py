"""HF-layout safetensors checkpoints: save (single file or sharded), selective load, block-FP8 dequantisation.

Layout: ``config.json``, then ``model.safetensors`` or shards ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``). Text names
under ``model.language_model.`` map to the canonical ``model.*`` (`canonical_name`), vision weights are skipped, flat
text-only checkpoints are read as they are. Block-FP8 weights are kept with their ``_scale_inv`` or dequantised
(``dequantize=True``; tiles in `trtllm_glm.quant.fp8`). `Glm5NextForCausalLM.load_weights` is the one strict gate
(names, shapes, finiteness) for every source. docs/model.md, "Checkpoints"; docs/fp8.md.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import Glm5NextConfig
from ..distributed.mapping import ParallelConfigError
from ..distributed.sharding import SKIP, Shard, ShardFn
from ..errors import CheckpointError
from ..quant.fp8 import FP8_MAX, block_scale_shape, dequantize_block_fp8, quantize_block_fp8

logger = logging.getLogger("trtllm_glm")

__all__ = [
    "SINGLE_FILE",
    "INDEX_FILE",
    "FP8_MAX",
    "save_checkpoint",
    "load_state_dict",
    "quantize_block_fp8",
    "dequantize_block_fp8",
    "canonical_name",
    "TEXT_PREFIX",
]

TEXT_PREFIX = "model.language_model."
"""Where the real (VL) checkpoint stores the text model's tensors."""
_VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "visual.", "vision_tower.")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def canonical_name(name: str) -> str | None:
    """The internal name of a checkpoint tensor (``model.language_model.X`` -> ``model.X``), or ``None``
    for a vision tensor (not part of the text model this package runs)."""
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX) :]
    if name.startswith(_VISION_PREFIXES):
        return None
    return name


_OWN_FILE_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------
def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _prepare(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU tensors; storage shared between entries (tied weights) is cloned apart
    because safetensors refuses to write aliased tensors."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
        c = t.detach().to("cpu").contiguous()
        key = (c.untyped_storage().data_ptr(), c.untyped_storage().nbytes())
        if c.numel() > 0 and key in seen:
            c = c.clone()
        seen.add((c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()))
        out[name] = c
    return out


def _remove_stale(directory: str) -> None:
    # A previous save with a different sharding would leave files the loader could pick up instead.
    for fname in os.listdir(directory):
        if fname == INDEX_FILE or _OWN_FILE_RE.match(fname):
            os.remove(os.path.join(directory, fname))


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: Glm5NextConfig,
    directory: str | os.PathLike[str],
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``config.json`` and the tensors in HF safetensors layout.

    Previous ``model*.safetensors`` / index files in ``directory`` are removed first so that a stale
    layout cannot shadow the new one. Tensors are written in ``state_dict`` order; a shard is closed
    when the next tensor would push it past ``max_shard_bytes`` (a single larger tensor gets a shard
    of its own).

    Args:
        state_dict: HF names -> tensors (any device; written as contiguous CPU copies).
        config: saved as ``config.json``.
        directory: created if missing.
        max_shard_bytes: ``None`` writes one ``model.safetensors``; otherwise shards plus the index
            (always, even if everything fits in one shard).

    Returns:
        The safetensors file names written, in order.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tensors = _prepare(state_dict)
    _remove_stale(directory)
    config.save(directory)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(directory, SINGLE_FILE), metadata=meta)
        return [SINGLE_FILE]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if not shards[-1]:  # empty state dict
        shards = [{}]
    n = len(shards)
    weight_map: dict[str, str] = {}
    files = []
    for i, shard in enumerate(shards):
        fname = _shard_name(i, n)
        save_file(shard, os.path.join(directory, fname), metadata=meta)
        files.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return files


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------
def _weight_map(directory: str) -> dict[str, str]:
    """Tensor name -> file name, from the index or the single file's header."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                index = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index_path}: not valid JSON ({e})") from e
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index_path}: missing a 'weight_map' object")
        return {str(k): str(v) for k, v in wm.items()}
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.exists(single):
        try:
            with safe_open(single, framework="pt", device="cpu") as f:
                return dict.fromkeys(f.keys(), SINGLE_FILE)
        except Exception as e:  # a truncated or foreign file
            raise CheckpointError(f"{single}: cannot read safetensors header ({e})") from e
    raise CheckpointError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")


def _wanted(name: str, layers: set[int] | None, num_layers: int, include_mtp: bool) -> bool:
    m = _LAYER_RE.match(name)
    if m is None:
        return True
    i = int(m.group(1))
    if i >= num_layers:
        return include_mtp
    return layers is None or i in layers


def load_state_dict(
    directory: str | os.PathLike[str],
    *,
    layers: Iterable[int] | None = None,
    include_mtp: bool = True,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    shard: ShardFn | None = None,
    stats: dict[str, int] | None = None,
    dequantize: bool = True,
) -> dict[str, torch.Tensor]:
    """Read an HF-layout checkpoint, optionally only some layers, block-FP8 weights dequantised or as they are.

    Only the selected tensors are read (``safe_open`` + ``get_tensor`` per key), and shards holding
    none of them are never opened. With ``shard`` (one rank of a tensor / expert parallel layout,
    `trtllm_glm.distributed.sharding.shard_fn`) each tensor is read through ``get_slice``: only the rank's
    rows / columns, another block's experts not at all, and a block-FP8 weight's ``_scale_inv`` cut by the
    same rule on its tiles (`read_sharded`).

    Args:
        directory: holds ``config.json`` and ``model.safetensors`` or the sharded index.
        layers: trunk layer indices to keep (``model.layers.{i}.*``); ``None`` keeps all. Non-layer
            weights (embedding, final norm, LM head) are always kept.
        include_mtp: keep the MTP layers ``model.layers.{num_hidden_layers + j}.*``.
        dtype: cast every floating tensor to this dtype (never an FP8 weight kept as FP8, nor its fp32
            scale); ``None`` keeps the stored dtypes, except that dequantised FP8 weights come back as fp32.
        device: where the returned tensors live (FP8 dequantisation happens there).
        shard: ``shard(canonical name, full shape)`` -> `SKIP` or ``(local name, Shard or None)``; the
            returned names are the local ones.
        stats: if given, ``stats["bytes_read"]`` grows by the bytes of tensor data read from the files.
        dequantize: ``True``: FP8 weights come back dequantised, without their ``*_scale_inv`` entries;
            ``False``: as stored (float8_e4m3fn next to the fp32 ``*_scale_inv``), checked the same way.

    Returns:
        Checkpoint names -> tensors.

    Raises:
        FileNotFoundError: missing directory, ``config.json``, safetensors files or a shard.
        KeyError: the index names a tensor its shard does not contain.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        what = "is a file, not a directory" if os.path.exists(directory) else "does not exist"
        raise CheckpointError(f"checkpoint directory {directory!r} {what}")
    cfg_path = os.path.join(directory, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{directory}: no config.json")
    config = Glm5NextConfig.from_json_file(cfg_path)
    block = config.quantization.weight_block_size[0] if config.quantization is not None else 128
    layer_set = None if layers is None else {int(i) for i in layers}

    wmap = _weight_map(directory)
    canon: dict[str, str] = {}  # canonical -> stored
    skipped = 0
    for k in wmap:
        c = canonical_name(k)
        if c is None:
            skipped += 1
            continue
        if c in canon:
            raise CheckpointError(f"{directory}: tensor {c!r} is stored twice (as {canon[c]!r} and {k!r})")
        canon[c] = k
    if skipped:
        logger.info(
            "%s: skipping %d vision tensors (model.visual.*): only the text model is served", directory, skipped
        )
    names = [k for k in canon if _wanted(k, layer_set, config.num_hidden_layers, include_mtp)]
    cuts: dict[str, Shard | None] = {}
    local_name: dict[str, str] = {}
    cut_after: dict[str, Shard] = {}
    if shard is not None:
        names, cuts, local_name, cut_after = _plan_shards(directory, wmap, canon, names, shard, block)
    by_file: dict[str, list[str]] = {}
    for k in names:
        by_file.setdefault(wmap[canon[k]], []).append(k)

    raw: dict[str, torch.Tensor] = {}
    for i, (fname, keys) in enumerate(by_file.items()):
        path = os.path.join(directory, fname)
        if len(by_file) > 1:  # progress of a sharded (large) checkpoint, one line per shard
            logger.info("%s: reading shard %d/%d (%s, %d tensors)", directory, i + 1, len(by_file), fname, len(keys))
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: shard missing (it holds {canon[keys[0]]!r} and {len(keys) - 1} more)")
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for k in keys:
                    if canon[k] not in present:
                        raise CheckpointError(f"{path}: {canon[k]!r} is listed in {INDEX_FILE} but not stored there")
                    raw[k] = read_sharded(f, canon[k], cuts.get(k))
                    if stats is not None:
                        stats["bytes_read"] = stats.get("bytes_read", 0) + raw[k].numel() * raw[k].element_size()
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e

    out: dict[str, torch.Tensor] = {}
    for k in names:
        if k.endswith(SCALE_SUFFIX):
            base = raw.get(k[: -len(SCALE_SUFFIX)])
            if base is not None and base.dtype == torch.float8_e4m3fn:
                continue  # consumed by its weight below
            raise CheckpointError(f"{wmap[canon[k]]}: {canon[k]!r} has no FP8 weight to scale")
        t = raw[k]
        scale_key = k + SCALE_SUFFIX
        keep_fp8 = False
        if t.dtype == torch.float8_e4m3fn:
            where = wmap[canon[k]]
            if scale_key not in raw:
                raise CheckpointError(f"{where}: FP8 tensor {canon[k]!r} has no {SCALE_SUFFIX} partner")
            module = canon[k].rsplit(".", 1)[0]
            quant = config.quantization
            if quant is not None and (quant.skips(module) or quant.skips(k.rsplit(".", 1)[0])):
                raise CheckpointError(
                    f"{where}: FP8 tensor {canon[k]!r} is listed in quantization_config.modules_to_not_convert"
                )
            scale = raw[scale_key]
            if not bool(torch.isfinite(scale).all()):
                raise CheckpointError(f"{where}: scale {canon[scale_key]!r} holds non-finite values")
            try:
                if k in cut_after:  # a cut inside a tile: dequantised whole, then cut; held in float
                    t = cut_after[k].apply(dequantize_block_fp8(t.to(device), scale, block))
                elif dequantize:
                    t = dequantize_block_fp8(t.to(device), scale, block)
                else:
                    if t.dim() != 2:
                        raise ValueError(f"block FP8 needs a 2-D tensor, got shape {tuple(t.shape)}")
                    want = block_scale_shape(t.shape, block)
                    if tuple(scale.shape) != want:
                        raise ValueError(
                            f"scale_inv shape {tuple(scale.shape)} does not match weight {tuple(t.shape)} "
                            f"with {block}x{block} blocks (expected {want})"
                        )
                    out[local_name.get(scale_key, scale_key)] = scale.to(device=device, dtype=torch.float32)
                    t = t.to(device)
                    keep_fp8 = True
            except ValueError as e:
                raise CheckpointError(f"{where}: {canon[k]}: {e}") from e
        else:
            t = t.to(device)
        if dtype is not None and t.is_floating_point() and not keep_fp8:
            t = t.to(dtype)
        out[local_name.get(k, k)] = t
    return out


def read_sharded(f: object, name: str, cut: Shard | None) -> torch.Tensor:
    """One tensor of an open safetensors file: whole (``cut`` ``None``) or only ``cut`` through ``get_slice``
    (the bytes outside the cut are never read)."""
    if cut is None:
        return f.get_tensor(name)  # type: ignore[attr-defined]
    sl = f.get_slice(name)  # type: ignore[attr-defined]
    return sl[cut.index(len(sl.get_shape()))]


def _plan_shards(
    directory: str,
    wmap: dict[str, str],
    canon: dict[str, str],
    names: list[str],
    shard: ShardFn,
    block: int,
) -> tuple[list[str], dict[str, Shard | None], dict[str, str], dict[str, Shard]]:
    """Apply the rank's sharding plan to the selected tensors (shapes from the file headers, no data read).

    A block-FP8 weight's ``_scale_inv`` follows its weight: the same dimension, cut on tile boundaries
    (`Shard.scale_shard`). A cut that falls inside a tile (a small matrix split finer than its tiles, e.g. KDA's
    ``b_proj`` of 64 rows at TP = 4) cannot keep FP8 with one scale per tile on each rank: that weight and its scale
    are read whole and returned in ``cut_after`` (the cut to apply once dequantised; the matrix is held in float).

    Returns:
        ``(names to read, read cuts, local names, cut_after)``.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[str, list[str]] = {}
    for k in names:
        by_file.setdefault(wmap[canon[k]], []).append(k)
    for fname, keys in by_file.items():
        path = os.path.join(directory, fname)
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                present = set(f.keys())
                for k in keys:
                    if canon[k] in present:
                        shapes[k] = tuple(f.get_slice(canon[k]).get_shape())
        except Exception as e:  # missing / corrupt shards are reported by the read that follows
            if os.path.exists(path):
                raise CheckpointError(f"{path}: cannot read safetensors header ({e})") from e
    kept: list[str] = []
    cuts: dict[str, Shard | None] = {}
    local: dict[str, str] = {}
    cut_after: dict[str, Shard] = {}
    selected = set(names)
    for k in names:
        if k.endswith(SCALE_SUFFIX):
            continue  # decided with its weight below
        if k not in shapes:  # not stored where the index says: the read below reports it
            kept.append(k)
            continue
        got = shard(k, shapes[k])
        if got == SKIP:
            continue
        assert not isinstance(got, str)
        local[k], cut = got
        kept.append(k)
        cuts[k] = cut
        scale = k + SCALE_SUFFIX
        if scale in selected:
            kept.append(scale)
            local[scale] = local[k] + SCALE_SUFFIX
            if cut is not None:
                try:
                    cuts[scale] = cut.scale_shard(shapes[k][cut.dim], block, canon[k])
                except ParallelConfigError:
                    cuts[k] = cuts[scale] = None
                    cut_after[k] = cut
                    logger.info("%s: %s is cut inside its %d-wide FP8 tiles; held dequantised", directory, k, block)
    return kept, cuts, local, cut_after
