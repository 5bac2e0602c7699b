"""The ``jetrl`` quantization method for vLLM: rollout runs the trainer's own linear op.

vLLM imports this module in every process it starts, through the ``vllm.general_plugins``
entry point of our package (``register``). A checkpoint written by ``export_vllm`` names the
method in its ``quantization_config``; vLLM then builds each linear with ``JetrlLinearMethod``:

- FP8 rollout recipes: ``weight`` is the trainer's float8_e4m3fn payload and ``weight_scale`` its
  power-of-two block scales, stored here one row per weight row (``BlockScaleRows``) so that any
  fused shard (qkv, gate_up) and any tensor-parallel split of the rows lands on the right scales.
  ``apply`` calls ``fp8_linear``, the op the compiler pass puts in the trainer: activations
  quantized in 1 x 128 groups, then the FP8 GEMM the trainer runs on this device
  (``kernels.fp8_kernel``). On a GPU that is the Triton kernel on the FP8 payload and these scales:
  the engine holds no BF16 copy of the weights. Where the GEMM is the emulation (CPU), the
  dequantized weight (in the BF16 GEMM path's operand dtype) is made once per load
  (``process_weights_after_loading``, which vLLM reruns on every in-place reload), not per token.
- BF16 rollout recipes: a BF16 ``weight`` and the same op with a BF16 forward.
- Exact mode (``set_exact``, turned on by ``rollout.vllm_exact`` for an exact-mode trainer): the
  same op with ``exact=`` the weight's fixed-point operand, remade on every load as well.

Classes live at module level: vLLM pickles the config into its engine process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from ..runtime import invariant
from ..runtime.format import FP8_DTYPE, GROUP
from ..runtime.fp8_linear import fp8_linear
from ..runtime.kernels import gemm_operand_dtype, uses_emulation
from ..runtime.quantize import dequantize
from ._vllm_compat import plugin_api
from .export import METHOD, is_power_of_two

LinearBase = plugin_api("LinearBase")
LinearMethodBase = plugin_api("LinearMethodBase")
UnquantizedLinearMethod = plugin_api("UnquantizedLinearMethod")
QuantizationConfig = plugin_api("QuantizationConfig")
BasevLLMParameter = plugin_api("BasevLLMParameter")
ModelWeightParameter = plugin_api("ModelWeightParameter")

_FIX = "re-export the checkpoint with jetrl_compile.export_vllm(model, path)"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``quant_method: jetrl`` known to vLLM."""
    plugin_api("register_quantization_config")(METHOD)(JetrlConfig)
    plugin_api("register_weight_loader_v2_supported_method")(JetrlLinearMethod)


class JetrlConfig(QuantizationConfig):
    """``quantization_config`` of a jetrl export (see ``export.quantization_config``)."""

    def __init__(self, recipe: str, rollout: str, modules: list[str]):
        super().__init__()
        if rollout not in ("fp8", "bf16"):
            raise ValueError(f"jetrl quantization_config: rollout {rollout!r} must be 'fp8' or 'bf16'; {_FIX}")
        self.recipe, self.rollout, self.modules = recipe, rollout, set(modules)

    def __repr__(self) -> str:
        return f"JetrlConfig(recipe={self.recipe!r}, rollout={self.rollout!r}, {len(self.modules)} linears)"

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # The GEMM is BF16 or FP8 either way; FP32 runs the non-GEMM ops like an FP32-master trainer.
        return [torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> JetrlConfig:
        return cls(config["recipe"], config["rollout"], config["modules"])

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        shards = [prefix.rsplit(".", 1)[0] + "." + s for s in self._shards(prefix)] if "." in prefix else [prefix]
        inside = [s in self.modules for s in shards]
        if all(inside):
            return JetrlLinearMethod(self, prefix)
        if any(inside):
            raise ValueError(
                f"vLLM fuses {shards} into {prefix}, but the export quantizes only some of them; "
                "skip all or none of a fused group (e.g. q/k/v, gate/up) in the recipe"
            )
        return UnquantizedLinearMethod()

    def _shards(self, prefix: str) -> list[str]:
        """HF module names vLLM fused into the layer at ``prefix`` (itself if not fused)."""
        leaf = prefix.rsplit(".", 1)[-1]
        return self.packed_modules_mapping.get(leaf, [leaf])


class BlockScaleRows(BasevLLMParameter):
    """128 x 128 block scales kept one row per weight row: row ``r`` holds the scales of block row
    ``r // 128``. The checkpoint stores ``(ceil(N/128), ceil(K/128))``; expanding on load makes
    every shard offset and tensor-parallel row split exact, including fused shards whose sizes
    are not multiples of 128 (SmolLM2's k/v: 192 rows), where block-row offsets would overlap.
    Read as 1 x 128 groups, it dequantizes every weight element with its own block's scale."""

    def __init__(self, data: torch.Tensor, weight_loader, name: str):
        super().__init__(data=data, weight_loader=weight_loader)
        self.checkpoint_name = name

    output_dim = 0
    input_dim = 1

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor):
        n = self.data.shape[0]
        self._copy(self.data, self._rows(loaded_weight, self.tp_rank * n, n, split_columns=False))

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor):
        self._copy(self.data, self._rows(loaded_weight, 0, self.data.shape[0], split_columns=True))

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs):
        offset, size = kwargs["shard_offset"], kwargs["shard_size"]
        rows = self._rows(loaded_weight, self.tp_rank * size, size, split_columns=False)
        self._copy(self.data.narrow(0, offset, size), rows)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs):
        offset, size = kwargs["shard_offset"], kwargs["shard_size"]
        shard_rank = self.tp_rank if kwargs["shard_id"] == "q" else self.tp_rank // kwargs["num_heads"]
        rows = self._rows(loaded_weight, shard_rank * size, size, split_columns=False)
        self._copy(self.data.narrow(0, offset, size), rows)

    def _rows(self, block_scales: torch.Tensor, start: int, size: int, *, split_columns: bool) -> torch.Tensor:
        """Rows ``start .. start+size`` of the checkpoint's weight, one scale row each."""
        _check_dtype(self.checkpoint_name, block_scales, torch.float32)
        cols = self.data.shape[1]
        if block_scales.dim() != 2 or block_scales.shape[0] * GROUP < start + size:
            raise ValueError(
                f"{self.checkpoint_name}: checkpoint scale of shape {tuple(block_scales.shape)} does not cover "
                f"weight rows {start}..{start + size} in 128-row blocks; {_FIX}"
            )
        if split_columns and self.tp_size > 1:
            block_scales = block_scales.narrow(1, self.tp_rank * cols, cols)
        if block_scales.shape[1] != cols:
            raise ValueError(
                f"{self.checkpoint_name}: checkpoint scale has {block_scales.shape[1]} block columns, "
                f"the layer needs {cols}; {_FIX}"
            )
        if not is_power_of_two(block_scales).all():
            raise ValueError(f"{self.checkpoint_name}: scales must be positive powers of two; {_FIX}")
        return block_scales.repeat_interleave(GROUP, dim=0).narrow(0, start, size)

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)


class CheckedWeight(ModelWeightParameter):
    """A linear weight that refuses a checkpoint tensor of the wrong dtype or shape by name
    (vLLM's own loaders would cast silently or fail on a bare assert)."""

    def __init__(self, *, name: str, **kwargs):
        super().__init__(**kwargs)
        self.checkpoint_name = name

    def _checked(self, method, loaded_weight: torch.Tensor, **kwargs):
        _check_dtype(self.checkpoint_name, loaded_weight, self.data.dtype)
        try:
            return method(self, loaded_weight, **kwargs)
        except (AssertionError, RuntimeError, IndexError) as e:
            raise ValueError(
                f"{self.checkpoint_name}: checkpoint tensor of shape {tuple(loaded_weight.shape)} does not fit "
                f"the layer's {tuple(self.data.shape)}; {_FIX}"
            ) from e

    def load_column_parallel_weight(self, loaded_weight):
        return self._checked(ModelWeightParameter.load_column_parallel_weight, loaded_weight)

    def load_row_parallel_weight(self, loaded_weight):
        return self._checked(ModelWeightParameter.load_row_parallel_weight, loaded_weight)

    def load_merged_column_weight(self, loaded_weight, **kwargs):
        return self._checked(ModelWeightParameter.load_merged_column_weight, loaded_weight, **kwargs)

    def load_qkv_weight(self, loaded_weight, **kwargs):
        return self._checked(ModelWeightParameter.load_qkv_weight, loaded_weight, **kwargs)


def _nan(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP8_DTYPE:  # torch.full has no float8 kernel; 0x7F is e4m3fn's NaN
        return torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8_DTYPE)
    return torch.full(shape, float("nan"), dtype=dtype)


def _check_dtype(name: str, t: torch.Tensor, expected: torch.dtype) -> None:
    if t.dtype != expected:
        raise ValueError(f"{name}: checkpoint tensor has dtype {t.dtype}, the jetrl method expects {expected}; {_FIX}")


class JetrlLinearMethod(LinearMethodBase):
    """One linear layer (possibly fused) running the trainer's op."""

    def __init__(self, config: JetrlConfig, prefix: str):
        self.config, self.prefix = config, prefix
        self.fp8 = config.rollout == "fp8"
        self.exact = False

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ):
        loader = extra_weight_attrs["weight_loader"]
        n, k = sum(output_partition_sizes), input_size_per_partition
        if k != input_size and k % GROUP:
            raise ValueError(
                f"{self.prefix}: tensor parallelism splits K={input_size} into {k} columns per rank, not a multiple "
                f"of {GROUP}; FP8 block scales cannot be split there. Use a tensor-parallel size that divides K/{GROUP}"
            )
        layer.logical_widths = output_partition_sizes
        layer.input_size_per_partition, layer.output_size_per_partition = k, n
        dtype = FP8_DTYPE if self.fp8 else torch.bfloat16
        # NaN until loaded: a tensor the checkpoint lacks is caught in process_weights_after_loading.
        weight = _nan((n, k), dtype)
        layer.register_parameter(
            "weight",
            CheckedWeight(data=weight, input_dim=1, output_dim=0, weight_loader=loader, name=f"{self.prefix}.weight"),
        )
        if self.fp8:
            scale = _nan((n, -(-k // GROUP)), torch.float32)
            layer.register_parameter(
                "weight_scale", BlockScaleRows(data=scale, weight_loader=loader, name=f"{self.prefix}.weight_scale")
            )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        for name in ("weight", "weight_scale") if self.fp8 else ("weight",):
            if torch.isnan(getattr(layer, name).float()).any():
                raise ValueError(
                    f"{self.prefix}.{name} was not (fully) loaded: the checkpoint lacks it or one of its shards; {_FIX}"
                )
        if self.fp8 and uses_emulation(layer.weight.device):
            deq = dequantize(layer.weight.data, layer.weight_scale.data, gemm_operand_dtype(layer.weight.device))
            layer.register_parameter("weight_dequantized", Parameter(deq, requires_grad=False))
        elif hasattr(layer, "weight_dequantized"):  # the kernel changed since the last load
            del layer.weight_dequantized
        self._make_fixed(layer)

    def set_exact(self, layer: torch.nn.Module, exact: bool) -> None:
        """Run this layer's GEMM as exact mode's trainer does (``invariant.gemm`` on the weight's
        fixed-point operand, made here and again after every reload) or as usual."""
        self.exact = exact
        self._make_fixed(layer)

    def _make_fixed(self, layer: torch.nn.Module) -> None:
        if not self.exact:
            layer.weight_fixed = False
        elif not invariant.needs_fixed_point(layer.weight.device, self.fp8):
            layer.weight_fixed = True  # a GPU's kernels are batch-invariant themselves (fp8_linear._exact_fprop)
        elif self.fp8:  # the trainer's WeightCache.get_fixed(w, "fp8") of the same payload and scales
            deq = dequantize(layer.weight.data, layer.weight_scale.data, torch.float32)
            layer.weight_fixed = invariant.FixedPoint(deq)
        else:  # get_fixed(w, "bf16"): the weight here is the trainer's BF16 copy
            layer.weight_fixed = invariant.FixedPoint(layer.weight.data)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        exact = getattr(layer, "weight_fixed", False)
        if not self.fp8:
            return fp8_linear(
                x, layer.weight, bias, None, None, fprop="bf16", dgrad="bf16", wgrad="bf16", exact=exact
            )
        deq = getattr(layer, "weight_dequantized", None)  # the emulation's operand; None for a real FP8 GEMM
        return fp8_linear(
            x, layer.weight if deq is None else deq, bias, layer.weight, layer.weight_scale, deq,
            fprop="fp8", dgrad="bf16", wgrad="bf16", exact=exact,
        )
