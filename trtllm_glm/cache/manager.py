"""Paged KV cache and per-request state slots for Glm5Next models.

One page pool is shared by all sparse MLA layers: a page holds, per sparse layer, every paged plane the attention
backend declares (`AttentionBackend.paged_planes`), so all planes share one slot-id space. KDA state (the slot planes
the KDA backend declares, `KdaBackend.slot_planes`) and the indexer tail rings are per-request *state slots*, owned by
the manager's `RequestStateOwner` (``manager.state``); the manager allocates slots and exposes the planes as views.
Plane shapes: docs/architecture.md, "Cache layout".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..attention.interface import AttentionBackend, PagedPlane
from ..attention.registry import resolve_attention_backend
from ..attention.sparse.glm_kpool.cache_layout import KpoolLayerCache
from ..config import INDEX_HEAD_DIM, INDEX_KPOOL, Glm5NextConfig
from ..errors import CapacityError, StateError
from ..kda.backend import KdaBackend, resolve_kda_backend
from ..state import KdaLayerState, RequestStateOwner, packed_copies
from ..transfer import to_device
from .index_keys import indexer_key_dtype as _key_dtype
from .latent_format import latent_dtype as _latent_dtype

__all__ = ["Glm5NextCacheManager", "KpoolLayerCache", "KdaLayerState", "PagedPlane"]


class Glm5NextCacheManager:
    """Page pool plus state slots, TensorRT-LLM KV-cache-manager style.

    Args:
        config: model geometry.
        num_pages: pages in the pool.
        tokens_per_block: tokens per page (a multiple of 4, so pools never straddle pages).
        max_num_requests: state slots (live requests at once).
        num_sparse_layers: sparse layers stored here; defaults to the trunk's sparse layers, plus one when
            ``include_mtp_layer`` (the shared-draft mode stores the MTP layer's pages here too).
        num_kda_layers: KDA layers with state here; defaults to the trunk's KDA layers (0 for a draft-only
            manager).
        dtype: the model dtype (the latent rows' unless ``latent_dtype="fp8"``).
        indexer_key_dtype: ``"fp8"`` (default) or ``"bf16"`` pooled index keys (`index_keys`).
        latent_dtype: ``"auto"`` (default: latent rows in ``dtype``) or ``"fp8"`` (e4m3 codes plus a power-of-two
            fp32 scale per 128 columns, the ``latent_scale`` plane; `latent_format`).
        device: where every plane lives.
        attention_backend: the sparse layers' backend (name or object; default the k-pool backend): its paged
            planes are what a page holds.
        kda_backend: the KDA layers' backend (default `KdaBackend`): its slot planes are what a state slot holds
            per KDA layer (``manager.state.planes``).

    Attributes:
        planes: name -> ``[L_s, num_pages, *shape]`` paged plane (`PagedPlane`); each is also an attribute
            (``manager.latent``), and a plane the backend may declare but this cache leaves out reads as None.
            The KDA backend's slot planes ``[L_k, S, *shape]`` read as attributes too (``manager.kda_recurrent``).
    """

    def __init__(
        self,
        config: Glm5NextConfig,
        *,
        num_pages: int,
        tokens_per_block: int,
        max_num_requests: int,
        num_sparse_layers: int | None = None,
        num_kda_layers: int | None = None,
        include_mtp_layer: bool = False,
        dtype: torch.dtype = torch.float32,
        indexer_key_dtype: str | torch.dtype = "fp8",
        latent_dtype: str | torch.dtype = "auto",
        device: torch.device | str = "cpu",
        attention_backend: str | AttentionBackend | None = None,
        kda_backend: KdaBackend | None = None,
    ) -> None:
        key_dtype = _key_dtype(indexer_key_dtype)
        lat_dtype = _latent_dtype(latent_dtype, dtype)
        if tokens_per_block <= 0 or tokens_per_block % INDEX_KPOOL:
            raise ValueError(f"tokens_per_block must be a positive multiple of {INDEX_KPOOL}, got {tokens_per_block}")
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if max_num_requests <= 0:
            raise ValueError(f"max_num_requests must be positive, got {max_num_requests}")
        self.config = config
        self.attention_backend = resolve_attention_backend(attention_backend)
        self.kda_backend = resolve_kda_backend(kda_backend)
        self.tokens_per_block = tokens_per_block
        self.num_pages = num_pages
        self.max_num_requests = max_num_requests
        self.dtype = dtype
        self.device = torch.device(device)
        if num_sparse_layers is None:
            num_sparse_layers = len(config.sparse_layer_ids) + int(include_mtp_layer)
        if num_kda_layers is None:
            num_kda_layers = len(config.kda_layer_ids)
        self.num_sparse_layers = num_sparse_layers
        self.num_kda_layers = num_kda_layers

        Ls, dev = num_sparse_layers, self.device
        self.index_key_dtype = key_dtype
        self.latent_dtype = lat_dtype
        self.paged_plane_specs = self.attention_backend.paged_planes(
            config, tokens_per_block=tokens_per_block, dtype=dtype, indexer_key_dtype=key_dtype, latent_dtype=lat_dtype
        )
        self.planes: dict[str, torch.Tensor] = {
            p.name: torch.zeros(Ls, num_pages, *p.shape, dtype=p.dtype, device=dev) for p in self.paged_plane_specs
        }
        S = max_num_requests
        self.state = RequestStateOwner(
            num_state_slots=S,
            num_sparse_layers=Ls,
            num_kda_layers=num_kda_layers,
            slot_planes=self.kda_backend.slot_planes(config),
            layer_state=self.kda_backend.layer_state,
            device=dev,
        )
        # A view of the owner's plane (the same storage), kept for the attention backend and tests; the KDA slot
        # planes read through `__getattr__` (``manager.kda_recurrent`` is ``manager.state.planes["kda_recurrent"]``).
        self.tail_ring = self.state.tail_ring

        # Host-side bookkeeping (the state owner keeps the free state slots). Free lists pop from the end;
        # reversed so that ids come out ascending.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        self._slot: dict[int, int] = {}
        self._num_tokens: dict[int, int] = {}
        # Block reuse (docs/design.md §6.4): sealed pages are registered under a content key. A sealed page
        # is shared read-only by every request that holds it (reference count); at zero holders it stays
        # cached (LRU, reclaimed only when the free list is empty) until a new allocation evicts it.
        self._key_page: dict[bytes, int] = {}
        self._page_key: dict[int, bytes] = {}
        self._page_refs: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()
        self.num_evicted_pages = 0

    @staticmethod
    def estimate_bytes(
        config: Glm5NextConfig,
        *,
        num_pages: int,
        tokens_per_block: int,
        max_num_requests: int,
        num_sparse_layers: int | None = None,
        num_kda_layers: int | None = None,
        include_mtp_layer: bool = False,
        dtype: torch.dtype = torch.float32,
        indexer_key_dtype: str | torch.dtype = "fp8",
        latent_dtype: str | torch.dtype = "auto",
        attention_backend: str | AttentionBackend | None = None,
        kda_backend: KdaBackend | None = None,
    ) -> int:
        """Bytes the constructor with these arguments allocates (to refuse early, before allocating)."""
        Ls = len(config.sparse_layer_ids) + int(include_mtp_layer) if num_sparse_layers is None else num_sparse_layers
        Lk = len(config.kda_layer_ids) if num_kda_layers is None else num_kda_layers
        S = max_num_requests
        specs = resolve_attention_backend(attention_backend).paged_planes(
            config,
            tokens_per_block=tokens_per_block,
            dtype=dtype,
            indexer_key_dtype=_key_dtype(indexer_key_dtype),
            latent_dtype=_latent_dtype(latent_dtype, dtype),
        )
        pages = num_pages * sum(p.bytes_per_page for p in specs)
        rings = S * 2 * INDEX_KPOOL * INDEX_HEAD_DIM * 4
        kda = S * sum(p.bytes_per_slot for p in resolve_kda_backend(kda_backend).slot_planes(config))
        return Ls * (pages + rings) + Lk * kda

    def __getattr__(self, name: str) -> Any:
        # The backend's paged planes by name (`manager.latent`); one it may declare but left out here reads as None
        # (the k-pool's FP8 scales with BF16 keys). Then the state owner's slot planes (`manager.kda_recurrent`).
        # Only reached when normal lookup fails.
        planes = self.__dict__.get("planes")
        backend = self.__dict__.get("attention_backend")
        if planes is not None and backend is not None and name in backend.plane_names:
            return planes.get(name)
        state = self.__dict__.get("state")
        if state is not None and name in state.planes:
            return state.planes[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def page_size(self) -> int:
        """Deprecated name of `tokens_per_block`."""
        return self.tokens_per_block

    @property
    def decode_tail_rings(self) -> list[Any]:
        """The state owner's tail-ring rollbacks, one per protected sparse plane (empty without speculation)."""
        return self.state.decode_tail_rings

    def enable_decode_tail_rings(self, max_rows: int, num_layers: int | None = None) -> None:
        """Give the first ``num_layers`` sparse planes (default all) a `DecodeTailRing` of ``max_rows``
        rows (``1 + num_speculative_tokens``), so that verify rounds can roll back rejected ring entries."""
        self.state.enable_decode_tail_rings(max_rows, num_layers)

    # --------------------------------------------------------------------------------------------
    # Request lifetime
    def add_request(
        self, request_id: int, num_tokens: int = 0, shared_pages: Sequence[int] = (), *, reset: bool = True
    ) -> int:
        """Give the request a zeroed state slot and pages for ``num_tokens``; returns the slot.

        Args:
            request_id: the request.
            num_tokens: tokens its pages must hold now.
            shared_pages: sealed pages (`seal_page`) the request starts with, in logical order: its first
                ``len(shared_pages)`` logical pages (a prefix hit). They are shared read-only.
            reset: zero the slot now; False leaves it to the caller, who must call `reset_state_slots` with it
                before anything reads or writes the slot (the executor zeroes a step's admissions at once).

        Raises:
            CapacityError: no free slot or too few pages (nothing is taken then).
            StateError: the request is already here, or a shared page is not a sealed page.
        """
        if request_id in self._slot:
            raise StateError(f"request {request_id} already holds state slot {self._slot[request_id]}")
        for p in shared_pages:
            if p not in self._page_key:
                raise StateError(f"page {p} is not a sealed page and cannot be shared")
        if not self.state.num_free_slots:
            raise CapacityError(
                f"no free state slot for request {request_id}: all {self.max_num_requests} slots are in use"
            )
        # Cached pages about to be shared must not count as room for the rest.
        reclaim = sum(1 for p in shared_pages if p in self._cached)
        need = self.pages_needed(num_tokens) - len(shared_pages)
        if need > self.num_free_pages - reclaim:
            raise CapacityError(
                f"request {request_id} needs {need} pages for {num_tokens} tokens but only "
                f"{self.num_free_pages - reclaim} of {self.num_pages} are free"
            )
        slot = self.state.acquire()
        self._slot[request_id] = slot
        for p in shared_pages:
            self._cached.pop(p, None)
            self._page_refs[p] = self._page_refs.get(p, 0) + 1
        self._pages[request_id] = list(shared_pages)
        self._num_tokens[request_id] = 0
        if reset:
            self.reset_state_slot(slot)
        self.ensure_capacity(request_id, num_tokens)
        return slot

    def ensure_capacity(self, request_id: int, num_tokens: int) -> list[int]:
        """Grow the request's page list to hold ``num_tokens`` tokens; returns the new page ids.

        All-or-nothing: on a capacity error no page is taken. Free pages go first, then cached sealed
        pages nobody holds, least recently released first (their content keys are dropped).
        """
        pages = self._get_pages(request_id)
        need = -(-num_tokens // self.tokens_per_block) - len(pages)
        if need <= 0:  # the common case (a decode step inside its last page): nothing to take
            if num_tokens > self._num_tokens[request_id]:
                self._num_tokens[request_id] = num_tokens
            return []
        if need > self.num_free_pages:
            raise CapacityError(
                f"request {request_id} needs {need} more pages for {num_tokens} tokens but only "
                f"{self.num_free_pages} of {self.num_pages} are free"
            )
        new = [self._take_page() for _ in range(need)]
        pages.extend(new)
        self._num_tokens[request_id] = max(self._num_tokens[request_id], num_tokens)
        return new

    def _take_page(self) -> int:
        if self._free_pages:
            return self._free_pages.pop()
        page, _ = self._cached.popitem(last=False)
        del self._key_page[self._page_key.pop(page)]
        self._page_refs.pop(page, None)
        self.num_evicted_pages += 1
        return page

    def _release_page(self, page: int) -> None:
        if page in self._page_key:
            self._page_refs[page] -= 1
            if self._page_refs[page] == 0:
                del self._page_refs[page]
                self._cached[page] = None  # most recently released last
        else:
            self._free_pages.append(page)

    # --------------------------------------------------------------------------------------------
    # Block reuse
    def seal_page(self, request_id: int, logical_page: int, key: bytes) -> bool:
        """Register the request's ``logical_page`` under the content ``key`` so later requests can share it.

        The caller guarantees the page's content is final (every row of every plane stored here that a
        sharer reads: docs/design.md §6.4). A page already sealed, or a key already held by another page
        (the same content computed twice), is left as it is.

        Returns:
            Whether the page was registered now.
        """
        pages = self._get_pages(request_id)
        page = pages[logical_page]
        if page in self._page_key or key in self._key_page:
            return False
        self._key_page[key] = page
        self._page_key[page] = key
        self._page_refs[page] = 1
        return True

    def drop_cached_pages(self) -> int:
        """Forget every sealed page no request holds (they return to the free list); returns how many. Pages
        that live requests share stay sealed."""
        n = len(self._cached)
        for page in self._cached:
            del self._key_page[self._page_key.pop(page)]
            self._page_refs.pop(page, None)
            self._free_pages.append(page)
        self._cached.clear()
        return n

    def lookup_pages(self, keys: Sequence[bytes]) -> list[int]:
        """Sealed pages of the longest prefix of ``keys`` that is cached here (page ids, logical order)."""
        out = []
        for k in keys:
            p = self._key_page.get(k)
            if p is None:
                break
            out.append(p)
        return out

    def is_sealed(self, page: int) -> bool:
        """Whether ``page`` is a sealed (shareable, read-only) page."""
        return page in self._page_key

    @property
    def num_cached_pages(self) -> int:
        """Sealed pages no request holds (kept for reuse; reclaimed when the free list runs out)."""
        return len(self._cached)

    def page_planes(self) -> dict[str, torch.Tensor]:
        """Byte views ``[L, num_pages, bytes_per_page_of_plane]`` of every paged plane.

        Each plane has its own bytes per page (latent rows, pooled keys, FP8 scales); a page copy indexes
        each view by page id, so it is strided by that plane's page size and never by a region's size. BF16
        keys have no scale plane.
        """
        return {
            # (The byte count spelled out: a manager without sparse layers has empty planes.)
            name: t.view(torch.uint8).reshape(t.shape[0], t.shape[1], t.shape[2:].numel() * t.element_size())
            for name, t in self.planes.items()
        }

    def copy_page_out(self, page: int) -> dict[str, torch.Tensor]:
        """A copy of ``page`` in every plane (every layer): plane name -> ``[L, bytes_per_page]`` uint8."""
        return packed_copies({name: v[:, page] for name, v in self.page_planes().items()})  # one allocation

    def copy_page_in(self, page: int, data: dict[str, torch.Tensor]) -> None:
        """Write a `copy_page_out` copy into ``page`` (a private page of the caller's request)."""
        if page in self._page_key:
            raise StateError(f"page {page} is sealed (shared, read-only)")
        views = self.page_planes()
        if set(views) != set(data) or any(views[k][:, page].shape != v.shape for k, v in data.items()):
            raise StateError("page copy does not match this manager's page geometry")
        for k, v in data.items():
            views[k][:, page].copy_(v)

    def set_num_tokens(self, request_id: int, num_tokens: int) -> None:
        """Record the committed length (may shrink after rejected drafts); pages are kept."""
        pages = self._get_pages(request_id)
        if self.pages_needed(num_tokens) > len(pages):
            raise CapacityError(f"request {request_id}: {num_tokens} tokens exceed its {len(pages)} pages")
        self._num_tokens[request_id] = num_tokens

    def free_request(self, request_id: int) -> None:
        """Return the request's pages and state slot to the pools."""
        pages = self._pages.pop(request_id, None)
        if pages is None:
            raise StateError(f"request {request_id} is not in the cache")
        for p in reversed(pages):
            self._release_page(p)
        self.state.release(self._slot.pop(request_id))
        del self._num_tokens[request_id]

    def reset_state_slot(self, slot: int) -> None:
        """Zero every per-request state plane of ``slot`` (KDA state, conv window, tail rings, backups)."""
        self.state.reset(slot)

    def reset_state_slots(self, slots: Sequence[int]) -> None:
        """`reset_state_slot` of several slots, one fill per plane (their index copied without a stream sync)."""
        if len(slots) > 1:
            self.state.reset_slots(slots, to_device(list(slots), self.state.tail_ring.device, torch.int64))
        else:
            self.state.reset_slots(slots)

    # --------------------------------------------------------------------------------------------
    # Queries
    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def has_request(self, request_id: int) -> bool:
        return request_id in self._slot

    def get_state_slot(self, request_id: int) -> int:
        if request_id not in self._slot:
            raise StateError(f"request {request_id} is not in the cache")
        return self._slot[request_id]

    def get_batch_state_slots(self, request_ids: Sequence[int]) -> list[int]:
        return [self.get_state_slot(r) for r in request_ids]

    def get_batch_slot_tables(self, request_ids: Sequence[int]) -> list[list[int]]:
        """Raw page ids of each request, logical page order (TensorRT-LLM's name)."""
        return [list(self._get_pages(r)) for r in request_ids]

    def page_lists(self, request_ids: Sequence[int]) -> list[list[int]]:
        """Like `get_batch_slot_tables` without the copies: the manager's own lists, to read at once and
        never modify (the metadata writes them into its staging every step)."""
        return [self._get_pages(r) for r in request_ids]

    def num_tokens(self, request_id: int) -> int:
        self._get_pages(request_id)
        return self._num_tokens[request_id]

    @property
    def num_free_pages(self) -> int:
        """Pages a request can take now: free ones plus cached sealed pages nobody holds."""
        return len(self._free_pages) + len(self._cached)

    @property
    def num_free_slots(self) -> int:
        return self.state.num_free_slots

    def _get_pages(self, request_id: int) -> list[int]:
        try:
            return self._pages[request_id]
        except KeyError:
            raise StateError(f"request {request_id} is not in the cache") from None

    # --------------------------------------------------------------------------------------------
    # Views
    def layer_cache(self, sparse_idx: int) -> Any:
        """The views the ``sparse_idx``-th sparse layer stored here reads (its backend's `layer_cache`)."""
        if not 0 <= sparse_idx < self.num_sparse_layers:
            raise IndexError(f"sparse layer {sparse_idx} not in [0, {self.num_sparse_layers})")
        return self.attention_backend.layer_cache(self, sparse_idx)

    def kpool_layer_cache(self, sparse_idx: int) -> KpoolLayerCache:
        """`layer_cache` under the k-pool backend's name (tests and benchmarks read the k-pool views through it)."""
        return self.layer_cache(sparse_idx)

    def kda_layer_state(self, kda_idx: int) -> KdaLayerState:
        """State planes of the ``kda_idx``-th KDA layer."""
        return self.state.kda_layer_state(kda_idx)

    # --------------------------------------------------------------------------------------------
    # Sizes
    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page over all sparse layers (every paged plane: latent (+ FP8 scales) + pooled keys (+ FP8
        scales))."""
        return sum(p.bytes_per_page for p in self.paged_plane_specs) * self.num_sparse_layers

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_page / self.tokens_per_block

    @property
    def state_bytes_per_request(self) -> int:
        """Bytes of one state slot: the KDA backend's slot planes (recurrent + conv state) and every tail ring."""
        return self.state.state_bytes_per_slot

    def bytes_per_request(self, num_tokens: int) -> int:
        """Bytes a request of ``num_tokens`` holds: its pages plus its state slot."""
        return self.pages_needed(num_tokens) * self.bytes_per_page + self.state_bytes_per_request

    def used_bytes(self) -> int:
        used_pages = self.num_pages - self.num_free_pages
        used_slots = self.max_num_requests - self.num_free_slots
        return used_pages * self.bytes_per_page + used_slots * self.state_bytes_per_request
