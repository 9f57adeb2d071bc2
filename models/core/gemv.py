"""``draftsmith::bf16_linear``: a bf16 linear layer at decoding's few rows, streamed (models/core/csrc/bf16_gemv.cpp).

At one row a decoding step's linears are matrix-vector products: each weight byte is used once, so the step can go
no faster than the weights stream from memory. oneDNN's packed GEMM (models/core/packed.py) reached ~10 GB/s there
on a Zen 5 (one thread), against the 22-30 GB/s the machine reads (scripts/compile_probe.py --profile). The kernel
here reads each weight row once, contiguously, and dots it with every x row while it sits in L1, with AVX-512 BF16's
``vdpbf16ps`` (bf16 products, fp32 sums). Its fp32 output is an fp32 GEMM of the same bf16 values up to the order of
the sums, so the fp32 head that ``fp32_logits`` adds (models/core/packed.py ``Fp32Head``) runs from the bf16 weight:
half its bytes.

The C++ source is compiled on first use by torch's extension builder (a C++ compiler and ninja; ~20 s on 2 cores,
cached by the source's hash under torch's extensions directory) and only on a CPU with ``avx512_bf16``. Anywhere
else, or if the build fails, ``load()`` says why and the callers keep oneDNN's kernel. Whether it is used is decided
by timing (eval/bench/decode_step.py), never assumed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import sys
from pathlib import Path

import torch

# up to this many rows the GEMV beats oneDNN's packed GEMM on SmolLM2's weights (bench/probe_smollm2_zen5_1t_gemv.json:
# lm_head at 8 rows 4.3 vs 5.1 ms, at 16 rows 9.0 vs 6.8: past 8 rows x is tiled and the weight read twice)
MAX_ROWS = 8
# one extension for the AVX-512 BF16 kernels: this GEMV and decoding attention (models/core/attention.py)
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("bf16_gemv.cpp", "gqa_decode.cpp")]
# a decoding step streams every weight once: ~66,000 4 KiB pages a SmolLM2 step, each a TLB miss. SmolLM2's linears
# in one buffer on 2 MiB pages ran 5 % faster than in separate allocations (Zen 5, one thread, interleaved:
# bench/gemv_pages/, scripts/bench_gemv_pages.py). Linux backs a range with them only when asked
# (transparent_hugepage=madvise, as here) and before the range is first touched.
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"]
_state: dict = {}
log = logging.getLogger(__name__)


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can); decided once per process."""
    if "why" not in _state:
        from models.core.cpu import cpu_features

        _state["why"] = "the CPU has no avx512_bf16" if "avx512_bf16" not in cpu_features()["flags"] else load()
    return _state["why"]


def ready() -> bool:
    """Whether the kernels are loaded in this process (``unavailable()`` was asked and said yes), without building
    them: cheap enough for a traced step to read."""
    return _state.get("why", "unchecked") is None


def load() -> str | None:
    """Build (once per source) and load the ops; None when ``torch.ops.draftsmith.bf16_linear`` and ``gqa_decode``
    are ready, else why."""
    if "error" not in _state:
        _state["error"] = _build()
    return _state["error"]


def _build() -> str | None:
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()).hexdigest()
        log.info("loading the bf16 kernels (built on first use on this machine: ~30 s)")
        cpp_extension.load(name=f"draftsmith_bf16_kernels_{digest[:12]}", sources=[str(p) for p in SOURCES],
                           extra_cflags=FLAGS, is_python_module=False, verbose=False)
    except Exception as e:  # a missing compiler or ninja: oneDNN's kernel stays
        why = f"the bf16 kernels did not build ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        log.warning(why)
        return why
    return None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call is the kernel's: bf16 on the CPU, few rows, no gradients wanted."""
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == weight.device.type == "cpu"
            and x.numel() <= MAX_ROWS * x.shape[-1] and not (torch.is_grad_enabled() and
                                                              (x.requires_grad or weight.requires_grad)))


# the op's schema and shape, known to tracing before the kernel (its CPU implementation) is built and loaded
_LIB = torch.library.Library("draftsmith", "FRAGMENT")
_LIB.define("bf16_linear(Tensor x, Tensor blocked, Tensor? bias, int N, bool fp32_out) -> Tensor")


@torch.library.register_fake("draftsmith::bf16_linear", lib=_LIB)
def _(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, N: int, fp32_out: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], N), dtype=torch.float32 if fp32_out else x.dtype)


def block(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] laid out for the kernel: [ceil(N/16), ceil(K/2), 16, 2], each 64-byte vector 16 output
    rows x 2 input columns (zero rows and column pad the edges)."""
    w = weight.detach().to(torch.bfloat16)
    n, k = w.shape
    w = torch.nn.functional.pad(w, (0, k % 2, 0, -n % 16))
    return w.view(w.shape[0] // 16, 16, w.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def pooled(tensors: list[torch.Tensor], advice: int = MADV_HUGEPAGE) -> list[torch.Tensor]:
    """Copies of ``tensors`` laid end to end, in the given order (the order a step reads them), in one buffer whose
    2 MiB-aligned part Linux is asked to back with huge pages (``HUGE_PAGE``); elsewhere, or if the kernel says no,
    the same buffer on small pages. ``advice``: MADV_NOHUGEPAGE asks for small pages (the benchmark's control)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    align = [-n % 64 for n in sizes]  # every copy starts on a cache line, as torch's own allocations do
    total = sum(sizes) + sum(align)
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is faulted in before the advice
    start = -raw.data_ptr() % HUGE_PAGE
    _advise(raw.data_ptr() + start, total, advice)
    out, at = [], start
    for t, n, pad in zip(tensors, sizes, align):
        out.append(raw[at:at + n].view(t.dtype).view(t.shape).copy_(t))
        at += n + pad
    return out


def _advise(addr: int, nbytes: int, advice: int) -> None:
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes // HUGE_PAGE * HUGE_PAGE), advice) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): the GEMV weights stay on small pages", ctypes.get_errno())
