"""GEMM kernels, chosen by device. The numerics contract is the same on every path.

**The GEMM definition.** Every GEMM a recipe defines, BF16 or FP8, is ``bf16(sum_k a[m,k] b[n,k])``
over BF16-valued operands (FP8 operands dequantize exactly to BF16 values) with float32
accumulation and one rounding to BF16. ``bf16_gemm`` computes it, on one of two paths:

- ``"native"``: torch's BF16 matmul. Fast where the hardware has BF16 dot products (CUDA; x86 with
  AVX-512 BF16 or AMX; Arm with BF16 through oneDNN).
- ``"fp32"``: an FP32 matmul of the exactly upcast operands, rounded once to BF16. The same
  definition (float32 products of BF16 values are exact; only the order of the float32 sums, which
  the definition leaves open, can differ). CPUs without BF16 dot products (AVX2-only x86, AVX-512
  without BF16) have no fast BF16 kernel: there torch's BF16 matmul ran 80x slower than FP32.

``bf16_gemm_path(device)`` picks the path: from the hardware (probed once per process), or as
``JETRL_BF16_GEMM=native|fp32`` forces it (``auto``, the default, probes). It is read when a GEMM
runs eagerly and when a graph is traced, so a compiled graph keeps the path it was traced with;
set the switch before ``unify`` and before starting an engine. Trainer and rollout engine in one
process call the same function, so they always take the same path and stay bitwise equal.

**FP8 GEMMs.** ``fp8_gemm(a, b)`` returns ``bf16(deq(a) @ deq(b)^T)`` with float32 accumulation, where ``a`` is an
``(M, K)`` payload in 1 x 128 groups along K and ``b`` an ``(N, K)`` payload in 128 x 128 blocks or
1 x 128 groups along K (see ``quantize.dequantize``). ``fp8_kernel(device)`` picks the kernel,
or ``JETRL_FP8_KERNEL`` forces it:

- ``"triton"``, the default on a CUDA GPU with FP8 tensor cores (sm89 and later) where Triton is
  installed: our Triton kernel (``triton_fp8``), real FP8 MMAs on the payloads and our scales, one
  fixed tile configuration, so batch-invariant. Forced on CPU tensors it runs under Triton's
  interpreter (``TRITON_INTERPRET=1``), which is how the default suite tests the GPU path.
- ``"emulate"``, the default everywhere else (CPU, older GPUs): dequantize both operands (exact,
  because scales are powers of two) and run ``bf16_gemm`` on them, dequantizing straight into the
  path's operand dtype (``gemm_operand_dtype``). Under torch.compile, Inductor fuses the dequantize
  into the loops that feed the matmul. This is not ``torch._scaled_mm``: on CPU that is a scalar
  reference loop (docs/design.md, pitfall 3). It is also the reference the kernels are tested against.
- ``"scaled_mm"`` (forced only): cuBLAS blockwise scaling (``torch.nn.functional.scaled_mm``, or
  ``torch._scaled_mm`` where torch has no ``F.scaled_mm``) on sm90, where K and N are multiples of
  128; other shapes take the Triton kernel. Not batch-invariant (cuBLAS picks its algorithm by shape).
"""

from __future__ import annotations

import importlib.util
import platform

import torch
import torch.nn.functional as F

from . import switches
from .format import GROUP, block_scale_shape
from .quantize import Quantized, dequantize, fake_quantize_groupwise, fused_quantize_groupwise

BF16 = torch.bfloat16
BF16_GEMM_PATHS = ("native", "fp32")


def bf16_gemm_path(device: torch.device | str) -> str:
    """``"native"`` or ``"fp32"``: how a GEMM of BF16 operands runs on ``device`` (module docstring)."""
    forced = switches.bf16_gemm()
    if forced != "auto":
        return forced
    if torch.device(device).type != "cpu":
        return "native"
    return "native" if cpu_has_bf16_dot_product() else "fp32"


def cpu_has_bf16_dot_product() -> bool:
    """Whether this CPU multiplies BF16 in hardware through torch's oneDNN matmul: AVX-512 BF16
    or AMX on x86, BF16 through oneDNN elsewhere."""
    return _CPU_HAS_BF16_DOT_PRODUCT


def _probe_cpu_bf16_dot_product() -> bool:
    # oneDNN honours ONEDNN_MAX_CPU_ISA, so a capped ISA counts as the CPU it is capped to.
    onednn_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        # Private torch.cpu probes (present in torch 2.11-2.13); a torch without them counts as no.
        probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return onednn_bf16 and any(getattr(torch.cpu, p, lambda: False)() for p in probes)
    return onednn_bf16


# A hardware fact, probed once per process at import: a plain constant for Dynamo to read when it
# traces bf16_gemm_path (the probe's torch.backends calls would break the graph).
_CPU_HAS_BF16_DOT_PRODUCT = _probe_cpu_bf16_dot_product()


def gemm_operand_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype ``bf16_gemm`` multiplies in on ``device``: BF16, or FP32 on the ``fp32`` path.
    Operands already made in it (the weight cache's dequantized weights) skip a conversion."""
    return torch.float32 if bf16_gemm_path(device) == "fp32" else BF16


def bf16_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``bf16(a @ b^T + bias)`` with float32 accumulation and one rounding, in BF16.

    ``a`` (M, K), ``b`` (N, K) and ``bias`` (N,) hold BF16 values, as BF16 tensors or as exact
    FP32 upcasts of them (dequantized FP8 operands are either); the caller rounds anything else
    to BF16 first. The bias joins the float32 accumulator before the rounding.
    """
    if gemm_operand_dtype(a.device) == BF16:
        return F.linear(a.to(BF16), b.to(BF16), None if bias is None else bias.to(BF16))
    return torch.ops.jetrl.gemm_fp32(a, b, bias)


@torch.library.custom_op("jetrl::gemm_fp32", mutates_args=())
def _gemm_fp32(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``fp32`` path of ``bf16_gemm``, one opaque op so that it runs the same code eagerly and
    compiled. Left to Inductor, the upcasts were materialised in other layouts and the bias fused
    into ``addmm``: the FP32 BLAS then summed in another order, and compiled results differed from
    eager ones by a BF16 ulp. Here the operands are always row-major and the bias joins the
    finished float32 sum."""
    y = torch.mm(a.float().contiguous(), b.float().contiguous().t())
    if bias is not None:
        y += bias.float()
    return y.to(BF16)


@_gemm_fp32.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=BF16)


@torch.library.custom_op("jetrl::fp8_gemm_triton", mutates_args=())
def _fp8_gemm_triton(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The ``triton`` kernel of ``fp8_gemm`` as one opaque op (``triton_fp8.launch``): the same
    launch eagerly, in compiled graphs and in vLLM. Triton is imported on the first call."""
    from . import triton_fp8

    return triton_fp8.launch(a, a_scale, b, b_scale, bias)


@_fp8_gemm_triton.register_fake
def _(a, a_scale, b, b_scale, bias):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=BF16)


def fp8_gemm(
    a: Quantized, b: Quantized, bias: torch.Tensor | None = None, b_dequantized: torch.Tensor | None = None
) -> torch.Tensor:
    """``bf16(deq(a) @ deq(b)^T + bias)``, the GEMM definition (module docstring).

    ``bias`` (BF16) is added to the float32 accumulator before the one rounding to BF16 (cuBLAS's
    ``scaled_mm`` adds it to the BF16 result, within the summation-order tolerance its check uses).
    ``b_dequantized``, when given, is ``dequantize(*b)`` made earlier (the weight cache keeps it
    per optimizer step, in ``gemm_operand_dtype``); the emulation then skips dequantizing the
    weight on every call. The real kernels ignore it.
    """
    kernel = fp8_kernel(a.data.device)
    if kernel == "scaled_mm" and _scaled_mm_fits(a.data, b):
        y = _scaled_mm_blockwise(a, b)
        return y if bias is None else y + bias
    if kernel != "emulate":
        return torch.ops.jetrl.fp8_gemm_triton(a.data, a.scale, b.data, b.scale, bias)
    dtype = gemm_operand_dtype(a.data.device)
    b_deq = dequantize(*b, dtype) if b_dequantized is None else b_dequantized
    return bf16_gemm(dequantize(*a, dtype), b_deq, bias)


def fp8_gemm_quantizing(
    x: torch.Tensor,
    b: Quantized,
    bias: torch.Tensor | None = None,
    b_dequantized: torch.Tensor | None = None,
    *,
    along_tokens: bool = False,
) -> torch.Tensor:
    """``fp8_gemm(quantize_groupwise(x), b, bias, b_dequantized)``, taking the activation
    unquantized so that its quantize runs as one fused kernel when called eagerly: fused with the
    dequantize for the emulation (``fake_quantize_groupwise``), alone before a real FP8 GEMM.
    Same result, bit for bit. ``along_tokens``: ``x``'s last dim is the token count (the wgrad's
    ``dy^T``), see ``fake_quantize_groupwise``."""
    if b_dequantized is not None and uses_emulation(x.device):
        x_deq = fake_quantize_groupwise(x, gemm_operand_dtype(x.device), along_tokens=along_tokens)
        return bf16_gemm(x_deq, b_dequantized, bias)
    return fp8_gemm(fused_quantize_groupwise(x, along_tokens=along_tokens), b, bias, b_dequantized)


def fp8_kernel(device: torch.device | str) -> str:
    """Which FP8 GEMM runs on ``device``: ``"triton"``, ``"emulate"`` or ``"scaled_mm"`` (module
    docstring). ``JETRL_FP8_KERNEL`` forces one; ``auto`` (the default) takes the Triton kernel on
    a CUDA GPU with FP8 tensor cores where Triton is installed, the emulation elsewhere. Read when
    a GEMM runs eagerly and when a graph is traced, as ``bf16_gemm_path`` is."""
    forced = switches.fp8_kernel()
    device = torch.device(device)
    if forced == "scaled_mm" and not (device.type == "cuda" and cuda_capability(device.index or 0)[0] == 9):
        raise ValueError(
            f"JETRL_FP8_KERNEL=scaled_mm: cuBLAS blockwise scaling runs on sm90 GPUs only, not on {device}; "
            "unset it for the default kernel"
        )
    if forced != "auto":
        return forced
    if device.type == "cuda" and cuda_capability(device.index or 0) >= (8, 9) and triton_installed():
        return "triton"
    return "emulate"


def uses_emulation(device: torch.device | str) -> bool:
    """Whether FP8 GEMMs on ``device`` run the emulation (and so use a dequantized weight)."""
    return fp8_kernel(device) == "emulate"


def kernel_name(device: torch.device | str) -> str:
    """The FP8 GEMM ``fp8_gemm`` runs on ``device``, in words (precision reports, benchmark tables)."""
    kernel = fp8_kernel(device)
    if kernel == "emulate":
        return f"emulated (dequantize + {bf16_gemm_name(device)})"
    if kernel == "scaled_mm":
        return "cuBLAS blockwise scaled_mm (K, N multiples of 128; else the Triton kernel)"
    where = "Triton interpreter" if torch.device(device).type == "cpu" else "tensor cores"
    return f"triton fp8 GEMM ({where})"


def bf16_gemm_name(device: torch.device | str) -> str:
    """The BF16 GEMM path on ``device``, in words (for reports and benchmark tables)."""
    if bf16_gemm_path(device) == "fp32":
        return "fp32 matmul of bf16 values"
    return "native bf16 matmul"


def cuda_capability(index: int) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(index)``, asked once per device: a plain dict entry for
    Dynamo to read when it traces a GEMM (every eager GEMM, weight load and unify has asked first)."""
    if index not in _CUDA_CAPABILITY:
        _CUDA_CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CUDA_CAPABILITY[index]


_CUDA_CAPABILITY: dict[int, tuple[int, int]] = {}


def triton_installed() -> bool:
    """Whether Triton can be imported (CUDA builds of torch bring it; the CPU install adds it for tests)."""
    return _TRITON_INSTALLED


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # found, not imported


def _scaled_mm_fits(a: torch.Tensor, b: Quantized) -> bool:
    """Whether cuBLAS's blockwise kernel takes ``a`` (the (M, K) payload) times ``b``."""
    k, n = a.shape[1], b.data.shape[0]
    b_layout_ok = tuple(b.scale.shape) in (block_scale_shape(b.data.shape), (n, k // GROUP))
    return b_layout_ok and k % GROUP == 0 and n % GROUP == 0


def _scaling_type(name: str):
    """``ScalingType.BlockWise1x128`` (torch 2.13) is spelled ``Blockwise_1x128`` in some releases."""
    from torch.nn.functional import ScalingType

    for spelling in (name, name.replace("BlockWise", "Blockwise_")):
        if hasattr(ScalingType, spelling):
            return getattr(ScalingType, spelling)
    raise RuntimeError(f"this torch's ScalingType has no {name}")


def _scaled_mm_blockwise(a: Quantized, b: Quantized) -> torch.Tensor:
    """``a`` (M, K) in 1x128 groups times ``b`` (N, K) in 128x128 blocks or 1x128 groups, as
    cuBLAS wants them: the second operand column-major (the transpose of a row-major ``b``),
    1x128 scales outer-dim-major, and 128x128 scales as (round_up(K/128, 4), N/128) with stride
    (1, round_up(K/128, 4)) (see ATen's ScaledBlas.cpp checks)."""
    mat_b = b.data.contiguous().t()
    scale_a = a.scale.t().contiguous().t()
    blockwise_b = tuple(b.scale.shape) == block_scale_shape(b.data.shape)
    if blockwise_b:
        k_blocks = b.scale.shape[1]
        scale_b = F.pad(b.scale, (0, -k_blocks % 4)).t()
        recipe_b = "BlockWise128x128"
    else:
        scale_b = b.scale.t().contiguous().t()
        recipe_b = "BlockWise1x128"
    if hasattr(F, "scaled_mm"):
        return F.scaled_mm(
            a.data, mat_b, scale_a, _scaling_type("BlockWise1x128"), scale_b, _scaling_type(recipe_b),
            output_dtype=torch.bfloat16,
        )
    # Older torch: _scaled_mm picks the blockwise kernel from the scales' shapes.
    return torch._scaled_mm(a.data, mat_b, scale_a, scale_b, out_dtype=torch.bfloat16)
