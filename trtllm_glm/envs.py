"""Every environment variable the package reads, declared once: its values, default and meaning (docs/settings.md).

``envs.PDL.get()`` parses ``os.environ`` at that moment, so a test's ``monkeypatch.setenv`` and a benchmark's A/B
in one process take effect at the next read; the few read once at import say so (``read``). A bad value raises
ValueError naming the variable and what it accepts. This module imports nothing of the package (a leaf).
``python -m trtllm_glm.envs --markdown`` prints the table of docs/settings.md; without arguments, the values now.
"""

from __future__ import annotations

import os
import sys
from abc import ABC, abstractmethod
from typing import Generic, TypeVar

__all__ = ["VARS", "Backend", "Choice", "Flag", "Float", "Int", "OffAtZero", "Str", "Switch", "Var", "markdown"]

T = TypeVar("T")


class Var(ABC, Generic[T]):
    """One variable. ``default``: the value while it is unset (and, with ``blank``, while it is empty). ``blank`` is
    per variable because the sites differed: those that refused an empty value before the registry still do."""

    def __init__(self, name: str, default: T, meaning: str, *, blank: bool = True, read: str = "each use") -> None:
        self.name, self.default, self.meaning, self.blank, self.read = name, default, meaning, blank, read
        if name in VARS:
            raise ValueError(f"{name} is declared twice")
        VARS[name] = self

    def get(self) -> T:
        """The value now (parsed from ``os.environ``)."""
        raw = os.environ.get(self.name)
        if raw is None or (self.blank and raw == ""):
            return self.default
        return self.parse(raw)

    @abstractmethod
    def parse(self, raw: str) -> T:
        """The value of a set variable (ValueError from `bad` when it is not one)."""

    @abstractmethod
    def values(self) -> str:
        """What it accepts, for the docs and the error messages."""

    def default_text(self) -> str:
        return "unset" if self.default is None else f"`{self.default}`"

    def bad(self, raw: str) -> ValueError:
        return ValueError(f"{self.name} must be {self.values()}, got {raw!r}")


def _words(options: tuple[str, ...]) -> str:
    return ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]


class Choice(Var[T]):
    """One of ``choices`` (``fold``: compared in lower case, as the variable always was)."""

    def __init__(self, name: str, choices: tuple[str, ...], default: T, meaning: str, *, fold: bool = False,
                 blank: bool = False, read: str = "each use") -> None:  # fmt: skip
        self.choices, self.fold = choices, fold
        super().__init__(name, default, meaning, blank=blank, read=read)

    def parse(self, raw: str) -> T:
        value = raw.lower() if self.fold else raw
        if value not in self.choices:
            raise self.bad(raw)
        return value  # type: ignore[return-value]

    def values(self) -> str:
        return _words(self.choices) + (" (any case)" if self.fold else "")


class Backend(Choice[str]):
    """``auto`` / ``torch`` / ``triton`` for one fused op with a torch reference (`triton_interp.kernel_backend`);
    ``op`` names it in messages."""

    CHOICES = ("auto", "torch", "triton")

    def __init__(self, name: str, op: str, meaning: str, *, default: str = "auto", blank: bool = False) -> None:
        self.op = op
        super().__init__(name, self.CHOICES, default, meaning, blank=blank)

    def check(self, value: str) -> str:
        """``value`` if it is a backend name (an explicit argument), else ValueError."""
        if value not in self.choices:
            raise ValueError(f"{self.op} backend must be one of {self.choices}, got {value!r}")
        return value

    def bad(self, raw: str) -> ValueError:
        return ValueError(f"{self.op} backend must be one of {self.choices}, got {raw!r} ({self.name})")


class Switch(Var[T]):
    """``0`` / ``1``; unset or empty: ``fallback``'s value when given, else ``default``."""

    def __init__(self, name: str, default: T, meaning: str, *, fallback: Switch | None = None) -> None:
        self.fallback = fallback
        super().__init__(name, default, meaning)

    def get(self) -> T:
        if self.fallback is not None and not os.environ.get(self.name):
            return self.fallback.get()
        return super().get()

    def parse(self, raw: str) -> T:
        if raw not in ("0", "1"):
            raise self.bad(raw)
        return raw == "1"  # type: ignore[return-value]

    def values(self) -> str:
        return "0 or 1"

    def default_text(self) -> str:
        if self.fallback is not None:
            return f"as `{self.fallback.name}`"
        return "unset" if self.default is None else f"`{int(bool(self.default))}`"


class Flag(Var[T]):
    """``1`` / ``0`` or on / off, true / false, yes / no, in any case and spacing; blank: ``default``."""

    ON, OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

    def parse(self, raw: str) -> T:
        value = raw.strip().lower()
        if value == "":
            return self.default
        if value in self.ON or value in self.OFF:
            return value in self.ON  # type: ignore[return-value]
        raise self.bad(raw)

    def values(self) -> str:
        return "1 or 0 (on / off, true / false, yes / no)"


class OffAtZero(Var[bool]):
    """On unless the value is ``0`` (any other value, or none, is on)."""

    def __init__(self, name: str, meaning: str) -> None:
        super().__init__(name, True, meaning)

    def parse(self, raw: str) -> bool:
        return raw != "0"

    def values(self) -> str:
        return "0 turns it off"

    def default_text(self) -> str:
        return "on"


class Int(Var[T]):
    """An int, at least ``minimum`` or one of ``choices`` (compared as written) when given."""

    def __init__(self, name: str, default: T, meaning: str, *, minimum: int | None = None,
                 choices: tuple[int, ...] = (), blank: bool = False, read: str = "each use") -> None:  # fmt: skip
        self.minimum, self.choices = minimum, tuple(str(c) for c in choices)
        super().__init__(name, default, meaning, blank=blank, read=read)

    def parse(self, raw: str) -> T:
        if self.choices:
            if raw not in self.choices:
                raise self.bad(raw)
            return int(raw)  # type: ignore[return-value]
        try:
            value = int(raw)
        except ValueError:
            raise self.bad(raw) from None
        if self.minimum is not None and value < self.minimum:
            raise self.bad(raw)
        return value  # type: ignore[return-value]

    def values(self) -> str:
        if self.choices:
            return " or ".join(self.choices)
        return "an int" + (f" >= {self.minimum}" if self.minimum is not None else "")


class Float(Var[T]):
    """A number greater than 0."""

    def __init__(self, name: str, default: T, meaning: str) -> None:
        super().__init__(name, default, meaning, blank=False)

    def parse(self, raw: str) -> T:
        try:
            value = float(raw)
        except ValueError:
            raise self.bad(raw) from None
        if value <= 0:
            raise self.bad(raw)
        return value  # type: ignore[return-value]

    def values(self) -> str:
        return "a number > 0"


class Str(Var[str]):
    """Any string; ``accepts`` says which values mean something."""

    def __init__(self, name: str, default: str, meaning: str, *, accepts: str, read: str = "each use") -> None:
        self.accepts = accepts
        super().__init__(name, default, meaning, blank=False, read=read)

    def parse(self, raw: str) -> str:
        return raw

    def values(self) -> str:
        return self.accepts


VARS: dict[str, Var] = {}

# Backends of fused ops with a torch reference: auto = the kernel for CUDA inference, torch = the reference,
# triton = the kernel on any device (the CPU through Triton's interpreter).
NORM_BACKEND = Backend("TRTLLM_GLM_NORM_BACKEND", "norm", "RMSNorm, the KDA gated norm and L2 norms (`norm/`)")
SWIGLU_BACKEND = Backend("TRTLLM_GLM_SWIGLU_BACKEND", "swiglu", "the clamped SwiGLU of a fused gate|up GEMM (`act/`)")
MHC_BACKEND = Backend("TRTLLM_GLM_MHC_BACKEND", "mHC", "the mHC block: pre, post, Sinkhorn (`modules/mhc.py`)")
LOGITS_BACKEND = Backend("TRTLLM_GLM_LOGITS_BACKEND", "logits", "greedy ids and the top-2 gap per row (`logits/`)")
SAMPLING_BACKEND = Backend(
    "TRTLLM_GLM_SAMPLING_BACKEND", "sampling", "the draw of sampled rows (top-k <= 256 in two launches; `logits/`)",
    default="torch", blank=True,
)  # fmt: skip
ROUTER_BACKEND = Backend("TRTLLM_GLM_ROUTER_BACKEND", "router", "the MoE router after its logits (`moe/router.py`)")
MOE_BACKEND = Backend("TRTLLM_GLM_MOE_BACKEND", "MoE", "routed experts: fused kernels or the per-expert torch loop")
SKINNY_GEMM_BACKEND = Backend(
    "TRTLLM_GLM_SKINNY_GEMM_BACKEND", "skinny GEMM", "fp32 GEMMs of <= 64 rows against 16-bit weights (`linear/`)"
)
INVARIANT_LINEAR_BACKEND = Backend(
    "TRTLLM_GLM_INVARIANT_LINEAR_BACKEND", "invariant linear", "the batch-invariant mode's GEMM (docs/numerics.md)"
)
FP8_LINEAR_BACKEND = Backend("TRTLLM_GLM_FP8_LINEAR_BACKEND", "FP8 linear", "block-FP8 linears (docs/fp8.md)")
TAIL_RING_BACKEND = Backend("TRTLLM_GLM_TAIL_RING_BACKEND", "tail ring", "the indexer tail ring's verify rollback")
KDA_GATE_BACKEND = Backend("TRTLLM_GLM_KDA_GATE_BACKEND", "KDA gate", "KDA decay and beta gates in one launch")
KDA_CONV_BACKEND = Backend("TRTLLM_GLM_KDA_CONV_BACKEND", "KDA conv", "the KDA short conv + SiLU + q/k norms")
MTP_STAGE_BACKEND = Backend(
    "TRTLLM_GLM_MTP_STAGE_BACKEND",
    "MTP staging",
    "a draft launched from a verify on the device: its inputs in one launch",
)
VERIFY_STAGE_BACKEND = Backend(
    "TRTLLM_GLM_VERIFY_STAGE_BACKEND",
    "verify staging",
    "a verify round launched ahead: its rows' description and inputs in one launch",
)
KPOOL_BACKEND: Choice[str] = Choice(
    "TRTLLM_GLM_KPOOL_BACKEND", Backend.CHOICES, "auto", "the sparse-MLA indexer and attention ops (auto: Triton on "
    "CUDA when it imports)", fold=True,
)  # fmt: skip
SPARSE_MLA_IMPL = Str(
    "TRTLLM_GLM_SPARSE_MLA_IMPL", "auto", "triton: never the Hopper (Gluon) sparse-MLA kernel",
    accepts="auto or triton (other values act as auto)", read="at import",
)  # fmt: skip
KDA_BACKEND: Choice[str] = Choice(
    "TRTLLM_GLM_KDA_BACKEND", ("auto", "torch", "fla"), "auto", "KDA prefill / decode: fla-core on CUDA when it "
    "imports; torch also selects the KDA gate, conv and verify references", fold=True,
)  # fmt: skip
KDA_SHORT_PREFILL: Int[int | None] = Int(
    "TRTLLM_GLM_KDA_SHORT_PREFILL", None, "prefill chunks of at most this many rows take the KDA verify recurrence "
    "instead of the chunked path (0: off; unset: 64 on CUDA, off elsewhere)", minimum=0, blank=True,
)  # fmt: skip
KDA_DECODE_RIDE: Int[int] = Int(
    "TRTLLM_GLM_KDA_DECODE_RIDE", 0, "in a step with short KDA prefills, its decode rows join their verify grid "
    "(one path instead of two) while the padding rows that adds stay at most this many (0: off)", minimum=0,
)  # fmt: skip
KDA_VERIFY: Choice[str | None] = Choice(
    "TRTLLM_GLM_KDA_VERIFY", Backend.CHOICES, None, "KDA verify + commit (unset: torch when "
    "`TRTLLM_GLM_KDA_BACKEND=torch`, else auto)", fold=True, blank=True,
)  # fmt: skip
MOE_ALIGN: Choice[str] = Choice(
    "TRTLLM_GLM_MOE_ALIGN", ("triton", "torch"), "triton", "the fused MoE's expert sort (a graph keeps its capture's)"
)

# Decode-step fusions and launch options.
PDL: Switch[bool | None] = Switch(
    "TRTLLM_GLM_PDL", None, "programmatic dependent launch of decode kernels on sm_90+ (unset: off, except FP8 "
    "launches whose tuned knobs ask for it)",
)  # fmt: skip
PDL_TRIGGER: Choice[str] = Choice(
    "TRTLLM_GLM_PDL_TRIGGER", ("start", "end"), "start", "where a PDL-launched kernel lets the next launch start: at "
    "its start, or after its main loop (docs/fp8.md, \"Launch overhead\")",
)  # fmt: skip
DECODE_FUSE: Switch[bool] = Switch(
    "TRTLLM_GLM_DECODE_FUSE", False, "the decode-step fusions at once where their own variables are unset"
)
MHC_FUSE: Switch[bool] = Switch(
    "TRTLLM_GLM_MHC_FUSE", False, "the fused mHC residual sites of decode", fallback=DECODE_FUSE
)
GREEDY_FUSE_CAST: Switch[bool] = Switch(
    "TRTLLM_GLM_GREEDY_FUSE_CAST", False, "the LM head's fp32 cast inside the greedy kernel", fallback=DECODE_FUSE
)
KDA_FUSED_DECODE: Switch[bool] = Switch(
    "TRTLLM_GLM_KDA_FUSED_DECODE", False, "a KDA layer's decode step from its input projection to `o_proj` in one "
    "kernel (CUDA, outside the batch-invariant mode)", fallback=DECODE_FUSE,
)  # fmt: skip
MOE_SKIP_DEAD_ROWS = OffAtZero("TRTLLM_GLM_MOE_SKIP_DEAD_ROWS", "the MoE leaves out rows marked dead (`row_live`)")
FP8_DEQUANT_MIN_ROWS: Int[int | None] = Int(
    "TRTLLM_GLM_FP8_DEQUANT_MIN_ROWS", None, "rows from which a 16-bit CUDA FP8 linear dequantises and calls cuBLAS "
    "(unset: `quant.ops.DEQUANT_MIN_ROWS`)", minimum=1,
)  # fmt: skip

# The batch-invariant mode (docs/numerics.md).
BATCH_INVARIANT: Flag[bool | None] = Flag(
    "TRTLLM_GLM_BATCH_INVARIANT", None, "the mode a process starts with, and what `LLM(batch_invariant=None)` "
    "takes (unset: off)", read="at import, and by each LLM",
)  # fmt: skip
INVARIANT_BLOCK_M: Int[int | None] = Int(
    "TRTLLM_GLM_INVARIANT_BLOCK_M", None, "the invariant GEMM's row tile; one value per process "
    "(unset: `linear.kernels.INVARIANT_BLOCK_M`)", choices=(16, 32, 64), blank=True,
)  # fmt: skip
INVARIANT_GROUP_N: Int[int | None] = Int(
    "TRTLLM_GLM_INVARIANT_GROUP_N", None, "weight tiles per program of the invariant GEMM, the same bits "
    "(unset: `linear.kernels.INVARIANT_GROUP_N`)", choices=(1, 4), blank=True,
)  # fmt: skip

# Graphs and speculation.
PIECEWISE: Flag[bool | None] = Flag(
    "TRTLLM_GLM_PIECEWISE", None, "prefill / mixed steps as piecewise CUDA graphs; overrides "
    "`CudaGraphConfig.piecewise` (unset: the config decides)",
)  # fmt: skip
GRAPH_UPLOAD = OffAtZero(
    "TRTLLM_GLM_GRAPH_UPLOAD", "each CUDA graph is uploaded to the device right after its capture (`cudaGraphUpload`), "
    "so that its first replay, inside a served or timed step, does not pay the upload (0: the first replay does)"
)  # fmt: skip
CHAIN_ADMISSIONS = OffAtZero(
    "TRTLLM_GLM_CHAIN_ADMISSIONS", "the overlap scheduler launches the decode step after an admission step from its "
    "tokens on the device (`Executor._may_chain_eager_step`)"
)  # fmt: skip
MTP_FUSED_DRAFT = OffAtZero("TRTLLM_GLM_MTP_FUSED_DRAFT", "the whole MTP draft as one CUDA graph where it can")
MTP_DEFER_DRAFTS = OffAtZero(
    "TRTLLM_GLM_MTP_DEFER_DRAFTS", "a fused draft's tokens stay on the device for the next verify"
)
MTP_FLUSH: Choice[str] = Choice(
    "TRTLLM_GLM_MTP_FLUSH", ("graphs", "eager"), "graphs", "how the MTP layer catches up on rows held by the catch-up "
    "lag: the catch-up graphs in slices of K + 1 rows per request, or one eager forward over all of them",
)  # fmt: skip

# Host side.
NUM_THREADS: Int[int | None] = Int(
    "TRTLLM_GLM_NUM_THREADS", None, "torch's intra-op CPU threads when `LLM(num_threads=None)` (unset: 1 for models "
    "under 50M parameters, else torch's default)", minimum=1, blank=True,
)  # fmt: skip
GRAMMAR_SERIAL_MAX: Int[int] = Int(
    "TRTLLM_GLM_GRAMMAR_SERIAL_MAX", 16, "grammar requests of a step whose masks are filled on the calling thread "
    "(more: llguidance's pool)", read="at import",
)  # fmt: skip
DIST_TIMEOUT: Float[float | None] = Float(
    "TRTLLM_GLM_DIST_TIMEOUT", None, "seconds a collective waits for a peer (unset: "
    "`distributed.process_group.DEFAULT_TIMEOUT_S`)",
)  # fmt: skip

# Set by torchrun, not by hand.
WORLD_SIZE: Int[int | None] = Int(
    "WORLD_SIZE", None, "torchrun: the number of processes (> 1: this process is one rank of them)"
)
RANK: Int[int | None] = Int("RANK", None, "torchrun: this process's rank")
LOCAL_RANK: Int[int | None] = Int("LOCAL_RANK", None, "torchrun: this process's rank on its host (unset: `RANK`)")


def markdown() -> str:
    """The table of docs/settings.md."""
    rows = ["| Variable | Values | Default | Read | Meaning |", "|---|---|---|---|---|"]
    for v in VARS.values():
        cells = (f"`{v.name}`", v.values(), v.default_text(), v.read, v.meaning)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _main(argv: list[str]) -> int:
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    if argv:
        sys.stderr.write("usage: python -m trtllm_glm.envs [--markdown]\n")
        return 2
    for v in VARS.values():
        try:
            value: object = v.get()
        except ValueError as e:
            value = f"error: {e}"
        raw = os.environ.get(v.name)
        print(f"{v.name:<36} {'unset' if raw is None else repr(raw):<10} -> {value}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
