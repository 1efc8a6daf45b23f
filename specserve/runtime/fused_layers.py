"""Every decoder layer of a forward in one call into the compiled library (`csrc/layers.cpp`): the lean
forward's as-shipped layer (runtime/decoder.py) without its per-layer Python and small tensor ops.

Once the weights are 4-bit and the products take one pass over them (runtime/cpu_kernels.py), a one-token
step of a small model spends about half its time between the products: a dozen tensor ops per layer
(norms, rotary, cache writes, casts, SiLU, residual adds), each a dispatch from Python. Here the
Python side describes the layers once (pointers into the model's own tensors, which it keeps alive) and
each forward once (the batch's rows, its segments' caches and masks), and the library runs them all.
Every step between the products is per row and per element, so a row's values do not depend on the rows
beside it, and speculation stays lossless against the same target alone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from specserve.runtime import cpu_kernels
from specserve.runtime.int4 import Int4Projections, int4_projections

if TYPE_CHECKING:
    from specserve.runtime.int4 import Int4Step
    from specserve.runtime.segment import ForwardBatch

_POINTER, _SIZE = ctypes.c_void_p, ctypes.c_int64


class _Product(ctypes.Structure):
    _fields_ = [
        ("codes", _POINTER),
        ("scales", _POINTER),
        ("biases", _POINTER),
        ("supers", _POINTER),
        ("bias", _POINTER),
        ("outputs", _SIZE),
        ("out_features", _SIZE),
        ("in_features", _SIZE),
        ("parts", _SIZE),
        ("group", _SIZE),
        ("bits", _SIZE),
        ("kind", _SIZE),
    ]


class _Products(ctypes.Structure):
    _fields_ = [("part", _Product * 3), ("count", _SIZE)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Products),
        ("gate_up", _Products),
        ("o", _Product),
        ("down", _Product),
        ("input_norm", _POINTER),
        ("post_norm", _POINTER),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
    ]


class _Segment(ctypes.Structure):
    _fields_ = [("lo", _SIZE), ("hi", _SIZE), ("start", _SIZE), ("visible", _POINTER)]


class _Forward(ctypes.Structure):
    _fields_ = [
        ("hidden", _POINTER),
        ("rows", _SIZE),
        ("hidden_size", _SIZE),
        ("heads", _SIZE),
        ("kv_heads", _SIZE),
        ("head_dim", _SIZE),
        ("intermediate", _SIZE),
        ("scale", ctypes.c_float),
        ("cos", _POINTER),
        ("sin_signed", _POINTER),
        ("segments", _SIZE),
        ("segment", ctypes.POINTER(_Segment)),
        ("keys", ctypes.POINTER(_POINTER)),
        ("values", ctypes.POINTER(_POINTER)),
        ("kv_head_stride", ctypes.POINTER(_SIZE)),
        ("kv_pos_stride", ctypes.POINTER(_SIZE)),
        ("layer_outputs", ctypes.POINTER(_POINTER)),
    ]


def _steps(ops: Sequence[Int4Projections]) -> list[Int4Step]:
    return [step for layer in ops for step in (*layer.qkv, layer.o, *layer.gate_up, layer.down)]


def norm_eps(norm: Any) -> float:
    """An RMSNorm module's epsilon, under either name transformers' models give it."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


class FusedLayers:
    """A decoder's layers, every product on the int8-dot kernel, described for `csrc/layers.cpp`."""

    def __init__(
        self,
        layers: Sequence[Any],  # the model's decoder layers (their norms and products)
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
    ) -> None:
        lib = cpu_kernels.library()
        assert lib is not None, "the compiled layers need the built library"
        self._run = lib.specserve_forward_layers
        self._run.argtypes = [ctypes.POINTER(_Layer), _SIZE, ctypes.POINTER(_Forward)]
        self._run.restype = None
        self.num_heads, self.num_kv_heads, self.head_dim, self.scaling = (
            num_heads,
            num_kv_heads,
            head_dim,
            scaling,
        )
        self.intermediate = int(layers[0].mlp.gate_proj.out_features)
        self._alive: list[torch.Tensor] = []  # every tensor a struct points into
        ops = int4_projections(layers)
        assert ops is not None, "every projection must run on int4 codes"
        self.layers = (_Layer * len(layers))()
        for index, (layer, layer_ops) in enumerate(zip(layers, ops, strict=True)):
            self.layers[index] = _Layer(
                self._products(layer_ops.qkv),
                self._products(layer_ops.gate_up),
                self._product(layer_ops.o),
                self._product(layer_ops.down),
                self._pointer(layer.input_layernorm.weight),
                self._pointer(layer.post_attention_layernorm.weight),
                norm_eps(layer.input_layernorm),
                norm_eps(layer.post_attention_layernorm),
            )

    @staticmethod
    def supports(layers: Sequence[Any], dtype: torch.dtype) -> bool:
        """Whether a decoder with these layers and this dtype can run here."""
        if dtype != torch.float32 or cpu_kernels.library() is None:
            return False
        ops = int4_projections(layers)
        return ops is not None and all(step.weight.kernel == "int8-dot" for step in _steps(ops))

    def _pointer(self, tensor: torch.Tensor) -> int:
        kept = tensor.detach().to(torch.float32).contiguous()
        self._alive.append(kept)
        return kept.data_ptr()

    def _product(self, step: Int4Step) -> _Product:
        weight = step.weight
        layout = weight.dot_layout
        return _Product(
            layout.codes.data_ptr(),
            layout.scales.data_ptr(),
            None if layout.biases is None else layout.biases.data_ptr(),
            None if layout.supers is None else layout.supers.data_ptr(),
            None if step.bias is None else self._pointer(step.bias),
            layout.outputs,
            weight.out_features,
            weight.in_features,
            weight.parts,
            weight.group,
            layout.bits,
            layout.kind,
        )

    def _products(self, steps: Sequence[Int4Step]) -> _Products:
        parts = (_Product * 3)(*(self._product(step) for step in steps))
        return _Products(parts, len(steps))

    def forward(
        self,
        hidden: torch.Tensor,  # [N, H] the embedded tokens, float32
        cos: torch.Tensor,  # [N, D]
        sin_signed: torch.Tensor,  # [N, D]: sin with its first half negated
        batch: ForwardBatch,
        layer_outputs: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states before the final norm [N, H]; each segment's K/V written into its cache (whose
        length moves past them); `layer_outputs` as NativeDecoder.forward fills it."""
        hidden = hidden.to(torch.float32).contiguous()
        cos, sin_signed = cos.to(torch.float32).contiguous(), sin_signed.to(torch.float32).contiguous()
        rows, size = hidden.shape
        num_layers, count = len(self.layers), len(batch.segments)
        segments = (_Segment * count)()
        keys, values = (_POINTER * (num_layers * count))(), (_POINTER * (num_layers * count))()
        head_strides, pos_strides = (_SIZE * (num_layers * count))(), (_SIZE * (num_layers * count))()
        alive: list[torch.Tensor] = []
        like = hidden.new_empty((1, self.num_kv_heads, 0, self.head_dim))
        for s, (segment, (lo, hi), mask) in enumerate(
            zip(batch.segments, batch.bounds, batch.masks, strict=True)
        ):
            visible = None
            if mask is not None:
                visible = mask[0, 0].to(torch.uint8).contiguous()  # [n, start + n]
                alive.append(visible)
            segments[s] = _Segment(
                lo, hi, segment.cache.length, None if visible is None else visible.data_ptr()
            )
            for index, cache_layer in enumerate(segment.cache.positional_layers):
                layer_keys, layer_values = cache_layer.reserve(hi - lo, like)
                at = index * count + s
                keys[at], values[at] = layer_keys.data_ptr(), layer_values.data_ptr()
                head_strides[at], pos_strides[at] = layer_keys.stride(1), layer_keys.stride(2)
        outputs = None
        if layer_outputs:
            outputs = (_POINTER * num_layers)()
            for index in layer_outputs:
                layer_outputs[index] = hidden.new_empty((rows, size))
                outputs[index] = layer_outputs[index].data_ptr()
        shape = (rows, size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate)
        rotary = (self.scaling, cos.data_ptr(), sin_signed.data_ptr())
        kv = (count, segments, keys, values, head_strides, pos_strides)
        forward = _Forward(hidden.data_ptr(), *shape, *rotary, *kv, outputs)
        self._run(self.layers, num_layers, ctypes.byref(forward))
        for segment, (lo, hi) in zip(batch.segments, batch.bounds, strict=True):
            end = segment.cache.length + (hi - lo)
            for cache_layer in segment.cache.positional_layers:
                cache_layer.length = end
        return hidden
