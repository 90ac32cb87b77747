"""`build_mtp`: the MTP drafter with its draft KV manager, draft vocabulary and CUDA graphs (the registry's
builder for ``decoding_type: MTP``)."""

from __future__ import annotations

from ...cache.manager import Glm5NextCacheManager
from ...config import Glm5NextConfig
from ..config import MTPDecodingConfig
from ..context import DraftContext, DraftResources
from ..draft_vocab import resolve_draft_vocab
from ..interface import draft_replay
from .drafter import MTPDrafter
from .graphs import MtpChainGraphs, defer_drafts_default

__all__ = ["build_mtp", "shares_selection"]


def shares_selection(spec: MTPDecodingConfig, config: Glm5NextConfig) -> bool:
    """Whether chained MTP steps reuse step 0's pool selection (``index_share_for_mtp_iteration``: the
    config's choice, else the model's)."""
    want = spec.index_share_for_mtp_iteration
    return config.index_share_for_mtp_iteration if want is None else bool(want)


def build_mtp(ctx: DraftContext, spec: MTPDecodingConfig) -> DraftResources:
    """The MTP layer's drafter. In ``shared`` mode its pages live in the target manager's last sparse plane
    (the executor made the target manager with it); in ``separate`` mode it gets its own manager and pool."""
    model, manager, sizes = ctx.model, ctx.manager, ctx.sizes
    K = spec.max_draft_len
    separate = spec.draft_kv_mode == "separate"
    if not separate:
        draft_manager, plane = manager, manager.num_sparse_layers - 1
    else:
        P = sizes.tokens_per_block
        draft_manager = Glm5NextCacheManager(
            model.config,
            num_pages=-(-(spec.draft_max_tokens or sizes.max_tokens) // P),
            tokens_per_block=P,
            max_num_requests=sizes.max_batch_size,
            num_sparse_layers=1,
            num_kda_layers=0,
            dtype=ctx.dtype,
            indexer_key_dtype=sizes.indexer_key_dtype,
            latent_dtype=sizes.latent_dtype,
            device=ctx.device,
            attention_backend=model.attention_backend,
        )
        plane = 0
    share = shares_selection(spec, model.config)
    # The restricted draft vocabulary's head rows: copied once here, before any graph captures them.
    vocab = resolve_draft_vocab(
        model.lm_head, model.config.vocab_size, spec.draft_vocab_size, spec.draft_vocab_file, model.checkpoint_dir,
        ctx.dtype, fp8=spec.draft_head_fp8,
    )  # fmt: skip
    drafter = MTPDrafter(
        model, ctx.meta, manager, draft_manager, plane, K,
        share_selection=share, draft_vocab=vocab, catchup_lag=spec.catchup_lag,
    )  # fmt: skip
    if ctx.graph_runner is not None:
        assert ctx.padding_slot is not None
        drafter.chain_graphs = MtpChainGraphs(
            ctx.graph_runner, model, draft_manager, plane,
            separate=separate, share_selection=share, padding_slot=ctx.padding_slot, replay_scope=draft_replay,
            max_draft_len=K, draft_vocab=vocab,
        )  # fmt: skip
        # The fused draft's tokens go straight into the next verify's input rows on the device.
        drafter.defer = defer_drafts_default()
    return DraftResources(drafter, draft_manager=draft_manager, draft_plane=plane, draft_vocab=vocab)
