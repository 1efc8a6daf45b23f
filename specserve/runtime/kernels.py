"""The matrix kernel behind every linear layer of a served model, chosen once at load.

On CPUs, torch's fp32 `F.linear` goes through MKL, which on AMD Zen streams a weight at 14-20 GB/s for
one row and charges about twice that for 2-8 rows: every drafted token then costs nearly a whole step.
oneDNN with the weight reordered ("packed") once into its blocked layout streams the same weight at
~36 GB/s and keeps 2-8 rows close to one (docs/benchmarks.md, "The linear kernel"). So on CPU every
`nn.Linear` of a served model becomes a `PackedLinear`, and groups of projections that read the same
input (q/k/v, gate/up) share one packed product, halving the kernel calls per layer. CUDA keeps cuBLAS.

Packing changes rounding in the last bits (any kernel does: a row of an M-row product is not bit-equal to
the one-row product either), but every forward of a model runs through the same kernel, so speculative
output still equals the target alone's token for token: the identity tests run on this path.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Projections that read the same input, in the order model code calls them (Llama, Qwen2, Mistral, ...).
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class LinearKernel(enum.StrEnum):
    AUTO = "auto"  # onednn where it applies (CPU, fp32 or bf16 the CPU packs, oneDNN built in), else native
    ONEDNN = "onednn"  # weights packed once for oneDNN; an error where it cannot run
    NATIVE = "native"  # torch's own F.linear (MKL on CPU, cuBLAS on CUDA)


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN packs weights of `dtype`: fp32 always; bf16 only with the instructions
    its bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT). An AVX2-only CPU (AMD Zen 3, for one)
    refuses to reorder a bf16 weight, so bf16 stays on torch's own kernel there."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def speed_dtype(dtype: str, device: torch.device | str) -> str:
    """A dtype chosen for speed alone (a profile's draft, generated training text), where float32 would be
    exact too: bfloat16 stays bfloat16 except on a CPU whose oneDNN has no bf16 path, where torch emulates
    it about 4x slower than packed float32 (AVX2-only CPUs such as AMD Zen 3)."""
    if dtype != "bfloat16" or torch.device(device).type != "cpu":
        return dtype
    return dtype if onednn_available() and onednn_packs(torch.bfloat16) else "float32"


def resolve_kernel(
    kernel: LinearKernel | str, device: torch.device | str, dtype: torch.dtype
) -> LinearKernel:
    """The kernel that will run: AUTO becomes ONEDNN on a CPU with oneDNN for fp32/bf16, else NATIVE."""
    kernel = LinearKernel(kernel)
    device_type = torch.device(device).type
    fits = device_type == "cpu" and onednn_available() and onednn_packs(dtype)
    if kernel is LinearKernel.AUTO:
        return LinearKernel.ONEDNN if fits else LinearKernel.NATIVE
    if kernel is LinearKernel.ONEDNN and not fits:
        from specserve.errors import FailedPrecondition

        raise FailedPrecondition(
            f"linear kernel onednn needs a CPU device, float32 (or bfloat16 on a CPU with AVX-512 or "
            f"AVX-NE-CONVERT) and a torch built with oneDNN (device {device_type}, dtype {dtype}, oneDNN "
            f"{onednn_available()}); use auto or native"
        )
    return kernel


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> the same weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] @ packed.T + bias -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1])  # [M, in]
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # [M, out]
    return y.reshape(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` whose weight lives only in oneDNN's packed layout (no second copy)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.packed = packed  # a plain attribute: mkldnn tensors cannot be buffers of a state dict
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(pack_weight(linear.weight), linear.bias, linear.in_features, linear.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in], unpacked on demand (for rare readers, e.g. a draft's head init)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=onednn"


class SplitProduct:
    """One kernel call whose output is split among projections that read the same input: the first
    projection computes the whole product and keeps the others' slices for their calls; a projection
    called on another input (a model whose code differs) computes its own slice: correct, only slower.
    Subclasses set `widths` and implement `parts`."""

    widths: list[int]

    def __init__(self) -> None:
        self._input: torch.Tensor | None = None
        self._slices: list[torch.Tensor] = []

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """[sum(out), in]: the concatenated weights as dense values (rare readers)."""
        raise NotImplementedError

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0 or self._input is not x:
            self._slices, self._input = self.parts(x), x
        out = self._slices[index]
        if index == len(self.widths) - 1:  # the last reader: drop the references
            self._input, self._slices = None, []
        return out


class FusedProduct(SplitProduct):
    """One packed oneDNN product over the concatenated weights of projections that read the same input."""

    def __init__(self, linears: Sequence[nn.Linear]):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum(out), in]
        biases = [linear.bias for linear in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach() if b is not None else weight.new_zeros(lin.out_features)
                    for b, lin in zip(biases, linears, strict=True)
                ]
            )
        )
        self.packed = pack_weight(weight)
        self.widths = [linear.out_features for linear in linears]
        self.total = sum(self.widths)

    def dense(self) -> torch.Tensor:
        """[sum(out), in]: the concatenated weights, unpacked on demand."""
        return self.packed.to_dense()

    def parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., in] -> every projection's output, [..., out_i] each, from one kernel call."""
        return list(packed_linear(x, self.packed, self.bias, self.total).split(self.widths, dim=-1))


class FusedPart(nn.Module):
    """One projection of a fused group (q, k or v; gate or up)."""

    def __init__(self, product: SplitProduct, index: int, in_features: int):
        super().__init__()
        self.product, self.index = product, index
        self.in_features, self.out_features = in_features, product.widths[index]

    @property
    def weight(self) -> torch.Tensor:
        start = sum(self.product.widths[: self.index])
        return self.product.dense()[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product.part(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused"


def _fuse_groups(module: nn.Module) -> None:
    """Replaces each complete group of same-input projections of `module` by parts of one product."""
    for group in FUSED_GROUPS:
        linears = [getattr(module, name, None) for name in group]
        if not all(type(linear) is nn.Linear for linear in linears):
            continue
        typed = [linear for linear in linears if isinstance(linear, nn.Linear)]
        if len({linear.in_features for linear in typed}) != 1 or any(
            lin.weight.requires_grad for lin in typed
        ):
            continue
        product = FusedProduct(typed)
        for index, name in enumerate(group):
            setattr(module, name, FusedPart(product, index, typed[0].in_features))


def apply_linear_kernel(model: nn.Module, kernel: LinearKernel | str = LinearKernel.AUTO) -> LinearKernel:
    """Packs every frozen `nn.Linear` of `model` for the kernel that `kernel` resolves to; returns it.

    Only for inference: packed weights take no gradients. Trainable linears (requires_grad) are left
    alone, so a draft in training keeps its own layers while its frozen parts get the fast kernel.
    """
    parameter = next(model.parameters(), None)
    if parameter is None:
        return LinearKernel.NATIVE
    resolved = resolve_kernel(kernel, parameter.device, parameter.dtype)
    if resolved is not LinearKernel.ONEDNN:
        return resolved
    with torch.no_grad():
        for module in list(model.modules()):
            _fuse_groups(module)
            for name, child in list(module.named_children()):
                if type(child) is nn.Linear and not child.weight.requires_grad:
                    setattr(module, name, PackedLinear.from_linear(child))
    return resolved


def model_linear_kernel(model: nn.Module) -> LinearKernel:
    """The kernel a model's linear layers run on now (what the bench and calibration record)."""
    for module in model.modules():
        if isinstance(module, PackedLinear) or (
            isinstance(module, FusedPart) and isinstance(module.product, FusedProduct)
        ):
            return LinearKernel.ONEDNN
    return LinearKernel.NATIVE
