"""Loading local causal LMs and tokenizers: local files only, safetensors only, inference mode."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.errors import FailedPrecondition, InvalidArgument, NotFound
from specserve.models.install import profile_dir
from specserve.models.profiles import DEFAULT_PROFILE, model_profile

if TYPE_CHECKING:
    import torch
    from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

    class CausalLM(PreTrainedModel, GenerationMixin):
        """What `load_causal_lm` returns: any AutoModelForCausalLM model, which has `generate`."""


_DTYPES = ("float32", "bfloat16", "float16")


def resolve_model_dir(model_dir: Path | None, cache_dir: Path, model: str = DEFAULT_PROFILE) -> Path:
    """The directory to load: `model_dir` if it is a model directory, else (None) the installed
    checkpoint of the profile named `model` (specserve/models/profiles.py)."""
    if model_dir is None:
        return profile_dir(model_profile(model), cache_dir)
    return _check_model_dir(Path(model_dir).expanduser())


def load_causal_lm(
    model_dir: Path,
    device: str = "cpu",
    dtype: str = "float32",
    linear_kernel: str = "native",
    as_shipped: Path | None = None,
    num_layers: int | None = None,
    int4_kernel: str = "auto",
) -> CausalLM:
    """Load a causal LM for inference: eval mode, no gradients, on `device` in `dtype`.

    linear_kernel (runtime/kernels.py): "native" keeps torch's F.linear and dense weights (what training
    needs, and the transformers reference); "auto" packs the weights for the fastest kernel of the device
    (oneDNN on CPU), "onednn" insists on it.
    as_shipped: a directory holding the model file's quantized weights (models/gguf_quant.py); every
    linear layer and embedding they cover then runs on them (runtime/int4.py) on `int4_kernel`
    (runtime/int4.INT4_KERNELS), the rest on `linear_kernel`.
    num_layers: load only the first decoder layers (an early-exit draft on a host without the target).
    """
    model_dir = _check_model_dir(Path(model_dir).expanduser())
    torch_dtype = _torch_dtype(dtype)
    # Pickle checkpoints can run code when loaded: accept safetensors weights only.
    if not any(model_dir.glob("*.safetensors")):
        raise FailedPrecondition(f"{model_dir} has no *.safetensors weights (pickle checkpoints are refused)")
    _offline()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a sub-second load needs no bar; it would interleave with output
    overrides = {} if num_layers is None else {"config": _first_layers(model_dir, num_layers)}
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        **overrides,
        local_files_only=True,
        use_safetensors=True,
        attn_implementation="sdpa",
        dtype=torch_dtype,
    )
    model.eval()
    model.requires_grad_(False)
    model = model.to(device=device, dtype=torch_dtype)  # type: ignore[call-arg]  # transformers wraps `to`
    if as_shipped is not None:
        from specserve.models.gguf_quant import STORE_FILE, read_store
        from specserve.runtime.int4 import apply_as_shipped, int4_available

        store = Path(as_shipped) / STORE_FILE
        if not store.is_file():
            raise FailedPrecondition(f"{as_shipped} holds no {STORE_FILE} (weights as shipped)")
        if not int4_available(device):
            raise FailedPrecondition(f"weights as-shipped need torch's int4 kernel, which {device} lacks")
        apply_as_shipped(model, read_store(store), kernel=int4_kernel)
    from specserve.runtime.kernels import apply_linear_kernel

    apply_linear_kernel(model, linear_kernel)  # after `to`: packed weights do not move with the model
    return model


def _first_layers(model_dir: Path, num_layers: int) -> object:
    """The checkpoint's config cut to its first `num_layers` decoder layers (the rest are not loaded)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise InvalidArgument(f"num_layers must be in [1, {config.num_hidden_layers}], got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    return config


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in `model_dir` (local files only)."""
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise NotFound(f"model directory {model_dir} does not exist")
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise NotFound(f"{model_dir} holds no tokenizer (no tokenizer.json or tokenizer_config.json)")
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def _check_model_dir(model_dir: Path) -> Path:
    if not model_dir.is_dir():
        raise NotFound(f"model directory {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise NotFound(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return model_dir


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    if dtype not in _DTYPES:
        raise InvalidArgument(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def _offline() -> None:
    # Belt and braces with local_files_only: nothing here may reach a model hub. (huggingface_hub reads
    # this at import time, so it only takes full effect if transformers was not imported yet.)
    os.environ["HF_HUB_OFFLINE"] = "1"
