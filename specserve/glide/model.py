"""The GliDe draft (Du et al., ICML 2024): a Llama block that glimpses the target's KV cache.

The paper's draft is one block; `GlideConfig.num_layers` stacks more, each as below, each reading its
target layer (`GlideConfig.layers_read`: the same one unless `block_target_layers` says otherwise).

    h = x + SelfAttn(RMSNorm_in(x))              causal, own KV cache, RoPE, GQA
    h = h + CrossAttn(h, target K/V of one layer) no norm before it (official code)
    y = h + SwiGLU(RMSNorm_post(h))
    logits = lm_head(RMSNorm_final(y))

Cross-attention owns only q_proj and o_proj: keys and values are the target's cached ones, already
RoPE-rotated, used as they are (no copy; GQA by folding query heads, never by repeating K/V). Only the
draft query is rotated, at its absolute position with the target's rope_theta.

Which target positions a query may see is given by a boolean cross mask [S, L]. Training uses the
block-wise mask (`blockwise_cross_mask`), which imitates inference, where the target cache lags the
draft by 1..gamma tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.sampling import make_generator
from specserve.errors import InvalidArgument, NotFound
from specserve.glide.config import GlideConfig
from specserve.runtime.kv_cache import PositionalKVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TargetKV = tuple[torch.Tensor, torch.Tensor]  # ([B, Hkv_t, L, Dt], same): one target layer's cache


def per_block(target_kv: TargetKV | Sequence[TargetKV], num_blocks: int) -> list[TargetKV]:
    """One target layer's K/V for every block, or one per block as given."""
    if isinstance(target_kv[0], torch.Tensor):
        return [cast("TargetKV", target_kv)] * num_blocks
    blocks = list(cast("Sequence[TargetKV]", target_kv))
    if len(blocks) != num_blocks:
        raise InvalidArgument(f"{len(blocks)} target layers' K/V for {num_blocks} draft blocks")
    return blocks


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in fp32, scale in the model dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))  # [H]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # [..., H]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [S] absolute -> (cos, sin): [S, D], Llama's half-split layout (as HF rotates keys)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    inv_freq = 1.0 / theta**exponents  # [D/2]
    freqs = positions.float()[:, None] * inv_freq[None]  # [S, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, D], cos/sin: [S, D] -> x rotated, [B, H, S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [B, H, S, D]
    return x * cos + rotated * sin


def attend(
    q: torch.Tensor,  # [B, Hq, S, D]
    k: torch.Tensor,  # [B, Hkv, L, D]
    v: torch.Tensor,  # [B, Hkv, L, D]
    mask: torch.Tensor | None,  # [S, L] bool, True = may attend; None = everything
    scale: float,
) -> torch.Tensor:
    """Scaled dot-product attention, softmax in fp32 -> [B, Hq, S, D].

    GQA: query heads g*G .. g*G + G-1 share kv head g (HF's repeat_kv order). Folding the G query heads
    into the query axis lets every kv head serve them without materialising repeated K/V, so the
    target's cache is read in place. A query row that may see nothing gets a zero output.
    """
    batch, num_q_heads, seq, head_dim = q.shape
    num_kv_heads = k.shape[1]
    groups = num_q_heads // num_kv_heads
    q = q.reshape(batch, num_kv_heads, groups * seq, head_dim)  # [B, Hkv, G*S, D]
    scores = (q @ k.transpose(-1, -2)).float() * scale  # [B, Hkv, G*S, L]
    if mask is not None:
        mask = mask.repeat(groups, 1)  # [G*S, L]
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [B, Hkv, G*S, L], fp32
    if mask is not None:
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # all -inf rows are NaN
    out = probs.to(v.dtype) @ v  # [B, Hkv, G*S, D]
    return out.reshape(batch, num_q_heads, seq, head_dim)


def _split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, S, heads * D] -> [B, heads, S, D]"""
    return x.view(*x.shape[:2], num_heads, -1).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, S, D] -> [B, S, heads * D]"""
    return x.transpose(1, 2).flatten(2)


class LayerShape(Protocol):
    """What a Llama-style self-attention and MLP need to know (GlideConfig and EagleConfig both say it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class SelfAttention(nn.Module):
    def __init__(self, config: LayerShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        cos: torch.Tensor,  # [S, D]
        sin: torch.Tensor,  # [S, D]
        cache: PositionalKVCache | None,  # None = the whole sequence is `x` (training)
        layer_index: int = 0,  # which of the cache's layers is this block's
    ) -> torch.Tensor:
        seq = x.shape[1]
        q = apply_rope(_split_heads(self.q_proj(x), self.num_heads), cos, sin)  # [B, Hq, S, D]
        k = apply_rope(_split_heads(self.k_proj(x), self.num_kv_heads), cos, sin)  # [B, Hkv, S, D]
        v = _split_heads(self.v_proj(x), self.num_kv_heads)  # [B, Hkv, S, D]
        start = 0
        if cache is not None:
            layer = cache.positional_layers[layer_index]
            start = layer.length
            k, v = layer.update(k, v)  # [B, Hkv, start + S, D]
        mask = None  # a single query sees the whole history
        if seq > 1:  # causal: query i (absolute start + i) sees keys 0 .. start + i
            mask = torch.ones(seq, start + seq, dtype=torch.bool, device=x.device).tril(start)  # [S, start+S]
        out = attend(q, k, v, mask, 1 / math.sqrt(self.head_dim))  # [B, Hq, S, D]
        return self.o_proj(_merge_heads(out))  # [B, S, H]


class CrossAttention(nn.Module):
    """Queries from the draft, keys/values = the target's cached K/V of one layer, as they are."""

    def __init__(self, config: GlideConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.target_num_heads, config.target_head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H]
        cos: torch.Tensor,  # [S, Dt], at the draft tokens' absolute positions
        sin: torch.Tensor,  # [S, Dt]
        target_k: torch.Tensor,  # [B, Hkv_t, L, Dt], already rotated
        target_v: torch.Tensor,  # [B, Hkv_t, L, Dt]
        mask: torch.Tensor | None,  # [S, L] bool
    ) -> torch.Tensor:
        q = apply_rope(_split_heads(self.q_proj(x), self.num_heads), cos, sin)  # [B, Ht, S, Dt]
        out = attend(q, target_k, target_v, mask, 1 / math.sqrt(self.head_dim))  # [B, Ht, S, Dt]
        return self.o_proj(_merge_heads(out))  # [B, S, H]


class SwiGLU(nn.Module):
    def __init__(self, config: LayerShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, S, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GlideBlock(nn.Module):
    def __init__(self, config: GlideConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.cross_attn = CrossAttention(config) if config.cross_attention else None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)


class FrozenEmbedding(nn.Module):
    """The target's input embedding, borrowed, never trained nor saved: its table [V, H] as a
    non-persistent buffer sharing the target's storage, or, where the target keeps no float table (an
    embedding on its file's codes, runtime/int4.Int4Embedding), the target's module itself, held outside
    this module's tree so that moving or saving the draft leaves it alone."""

    def __init__(self, source: torch.Tensor | nn.Module) -> None:  # [V, H] or an embedding module
        super().__init__()
        self._module: tuple[nn.Module, ...] = ()
        if isinstance(source, torch.Tensor):
            self.register_buffer("weight", source.detach(), persistent=False)
        else:
            self._module = (source,)

    @property
    def shape(self) -> tuple[int, int]:
        """[V, H] of the table, whichever way it is held."""
        if self._module:
            module = self._module[0]
            return int(cast(int, module.num_embeddings)), int(cast(int, module.embedding_dim))
        rows, width = cast(torch.Tensor, self.weight).shape
        return int(rows), int(width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, S, H]
        if self._module:
            return self._module[0](input_ids)
        return F.embedding(input_ids, cast(torch.Tensor, self.weight))


def borrowed_embedding(target_model: nn.Module) -> torch.Tensor | nn.Module:
    """What a draft borrows of `target_model`'s input embedding: its table [V, H], or the module itself
    when it is not a plain table (an embedding on its file's codes: no float copy is made)."""
    embeddings = cast("PreTrainedModel", target_model).get_input_embeddings()
    return embeddings.weight if isinstance(embeddings, nn.Embedding) else embeddings


class GlideDraft(nn.Module):
    draft_token_ids: torch.Tensor  # [V_draft] buffers, with a reduced head: target id of each head row
    draft_index: torch.Tensor  # [V]: head row of each target id, -100 outside

    def __init__(
        self,
        config: GlideConfig,
        # [V, H] or an embedding module (`borrowed_embedding`); required iff share_target_embeddings
        target_embedding: torch.Tensor | nn.Module | None = None,
        draft_token_ids: torch.Tensor | None = None,  # [V_draft] full ids the reduced head scores
    ) -> None:
        super().__init__()
        self.config = config
        if config.share_target_embeddings:
            expected = (config.vocab_size, config.hidden_size)
            borrowed = None if target_embedding is None else FrozenEmbedding(target_embedding)
            if borrowed is None or borrowed.shape != expected:
                raise InvalidArgument("share_target_embeddings needs the target's [vocab, hidden] embedding")
            self.embed_tokens: nn.Module = borrowed
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GlideBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.head_vocab_size, bias=False)
        if config.draft_vocab_size is not None:
            ids = torch.arange(config.draft_vocab_size) if draft_token_ids is None else draft_token_ids
            register_draft_vocab(self, ids, config.draft_vocab_size, config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        target_kv: TargetKV | Sequence[TargetKV],  # one target layer for all blocks, or one per block
        cross_mask: torch.Tensor | None,  # [S, L] bool, True = may attend; None = all L positions
        positions: torch.Tensor | None = None,  # [S] absolute; None = 0 .. S-1 (training)
        cache: PositionalKVCache | None = None,  # the draft's own KV; None = no history (training)
    ) -> torch.Tensor:
        """-> final-normed hidden states [B, S, H]; `logits` / `draft_logits` turn them into scores."""
        seq = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device)  # [S]
        h = self.embed_tokens(input_ids)  # [B, S, H]
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)  # [S, D]
        cross_cos, cross_sin = cos, sin
        if self.config.target_head_dim != self.config.head_dim:
            cross_cos, cross_sin = rope_cos_sin(
                positions, self.config.target_head_dim, self.config.rope_theta, h.dtype
            )
        blocks = cast("list[GlideBlock]", self.layers)
        kv_of_block = per_block(target_kv, len(blocks))
        for index, (block, block_kv) in enumerate(zip(blocks, kv_of_block, strict=True)):
            h = h + block.self_attn(block.input_layernorm(h), cos, sin, cache, index)
            if block.cross_attn is not None:  # no norm first (official code)
                h = h + block.cross_attn(h, cross_cos, cross_sin, *block_kv, cross_mask)
            h = h + block.mlp(block.post_attention_layernorm(h))
        return self.norm(h)  # [B, S, H]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V_draft] (the full vocabulary when the head is not reduced)."""
        return self.lm_head(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] over the target's vocabulary; tokens outside a reduced head get -inf,
        so greedy, top-k and sampling never pick them and the target's verification stays exact."""
        scores = self.draft_logits(hidden)  # [..., V_draft]
        if self.config.draft_vocab_size is None:
            return scores
        return scatter_to_vocab(scores, self.draft_token_ids, self.config.vocab_size)

    def top_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [...] the target-vocabulary id of the highest score: `logits(hidden).argmax(-1)`,
        without building the [..., V] scores (what scoring a draft over thousands of positions needs)."""
        reduced = self.config.draft_vocab_size is not None
        return vocab_argmax(self.draft_logits(hidden), self.draft_token_ids if reduced else None)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy. hidden: [B, S, H], labels: [B, S] full ids (-100 = ignore).

        With a reduced head, labels outside it are ignored: the head cannot score them.
        """
        scores = self.draft_logits(hidden).float()  # [B, S, V_draft]
        if self.config.draft_vocab_size is not None:
            labels = torch.where(labels >= 0, self.draft_index[labels.clamp_min(0)], labels)  # [B, S]
        return F.cross_entropy(scores.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        init_draft_weights(self, generator, std)


@torch.no_grad()
def init_draft_weights(model: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Normal(0, std) for every trainable matrix, ones for norms; deterministic given `generator`."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.copy_(torch.randn(param.shape, generator=generator) * std)


# --- a reduced LM head: the draft scores its most frequent tokens only ----------------------------


def register_draft_vocab(
    module: nn.Module, draft_token_ids: torch.Tensor, size: int, vocab_size: int
) -> None:
    """Checks a reduced head's id map ([size] distinct target ids) and registers it on `module`:
    `draft_token_ids` (saved: the map belongs to the trained head) and `draft_index` ([V], the head row
    of each target id, -100 outside; derived, for the losses)."""
    ids = draft_token_ids.long().flatten()  # [V_draft]
    if len(ids) != size or len(set(ids.tolist())) != len(ids):
        raise InvalidArgument(f"draft_token_ids must hold {size} distinct ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InvalidArgument("draft_token_ids must be ids of the target vocabulary")
    index = torch.full((vocab_size,), -100, dtype=torch.long)  # [V]; -100 = outside
    index[ids] = torch.arange(len(ids))
    module.register_buffer("draft_token_ids", ids)
    module.register_buffer("draft_index", index, persistent=False)


def scatter_to_vocab(scores: torch.Tensor, draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., V_draft] head scores -> [..., V] over the target's vocabulary, -inf outside the head, so no
    rule ever picks such a token and the target's verification stays exact."""
    full = scores.new_full((*scores.shape[:-1], vocab_size), float("-inf"))  # [..., V]
    return full.index_copy(-1, draft_token_ids, scores)


def vocab_argmax(scores: torch.Tensor, draft_token_ids: torch.Tensor | None) -> torch.Tensor:
    """[..., V_draft] head scores -> [...] the target-vocabulary id of the highest: the lowest such id
    where scores tie, as `scatter_to_vocab(scores, ...).argmax(-1)` picks, in [..., V_draft] memory.
    draft_token_ids None: a full head, whose rows are the ids."""
    if draft_token_ids is None:
        return scores.argmax(-1)
    best = scores.amax(-1, keepdim=True)  # [..., 1]
    ids = draft_token_ids.to(scores.device).expand_as(scores)  # [..., V_draft]
    return torch.where(scores == best, ids, torch.iinfo(ids.dtype).max).amin(-1)


# --- which target positions each draft query may see --------------------------------------------


def trained_cross_lengths(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions: [S] -> [S] number of leading target positions the training mask lets each query see.

    A query at t in block b = t // block_size sees target positions < block_size * b; the first block
    sees t itself and before (normal causal), since it has no earlier block to look at.
    """
    block_start = positions // block_size * block_size  # [S]
    return torch.where(positions < block_size, positions + 1, block_start)


def cross_mask_from_lengths(lengths: torch.Tensor, num_keys: int) -> torch.Tensor:
    """lengths: [S] -> [S, num_keys] bool, row i True on its first lengths[i] keys."""
    return torch.arange(num_keys, device=lengths.device)[None] < lengths[:, None]


def blockwise_cross_mask(seq_len: int, block_size: int = 5) -> torch.Tensor:
    """Training's cross mask for a sequence and its own target K/V: [seq_len, seq_len] bool.

    Worked example, block_size 2, seq_len 5 (rows = draft queries, columns = target positions):
        t=0: 10000   t=1: 11000   (first block: causal)
        t=2: 11000   t=3: 11000   (block 1: positions < 2)
        t=4: 11110                (block 2: positions < 4)
    At inference the root at position L sees target positions < L and the j-th draft token after it
    also < L: lags of 1..gamma, which blocks of size gamma + 1 cover.
    """
    return cross_mask_from_lengths(trained_cross_lengths(torch.arange(seq_len), block_size), seq_len)


def frequency_ranked_ids(token_counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """token_counts: [V] occurrences in the training data -> [V_draft] most frequent ids, most first."""
    return torch.topk(token_counts.float(), draft_vocab_size).indices


# --- building, saving and loading ---------------------------------------------------------------

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def build_glide(
    target_model: nn.Module,
    seed: int = 0,
    draft_token_ids: torch.Tensor | None = None,
    **overrides: object,
) -> GlideDraft:
    """A randomly initialised draft fitted to `target_model` (a HF causal LM), on its device and dtype.

    Returned in eval mode without gradients, like every loaded model; training re-enables them.
    """
    config = GlideConfig.from_target(target_model.config, **overrides)
    model = _new_draft(config, target_model, draft_token_ids)
    model.init_weights(make_generator(seed))
    return _for_inference(model, target_model)


def save_glide(model: GlideDraft, directory: Path, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors (never pickle). A shared target embedding is not stored.

    dtype: store floating weights in it (bf16 halves a shipped draft); loading casts to the target's.
    """
    return save_draft(model, model.config, directory, dtype)


class DraftConfig(Protocol):
    def save(self, path: Path) -> None: ...


def save_draft(
    model: nn.Module, config: DraftConfig, directory: Path, dtype: torch.dtype | None = None
) -> Path:
    """config.json (`config.save`) + model.safetensors (never pickle) of any draft: its state dict, so a
    buffer of ids is stored and a borrowed, unregistered target embedding is not."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config.save(directory / CONFIG_FILE)
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if dtype is not None:
        tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def load_glide(directory: Path, target_model: nn.Module | None = None) -> GlideDraft:
    """Loads a draft saved by `save_glide`; with `target_model`, checks it fits and matches its device/dtype.

    A draft sharing the target's embedding needs `target_model`.
    """
    from safetensors.torch import load_file

    directory = Path(directory).expanduser()
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise NotFound(f"{directory} holds no GliDe draft ({CONFIG_FILE} + {WEIGHTS_FILE})")
    config = GlideConfig.load(directory / CONFIG_FILE)
    if target_model is not None:
        config.check_target(target_model.config)
    elif config.share_target_embeddings:
        raise InvalidArgument("this GliDe draft shares the target's embedding: pass the target model")
    state = _with_block_list(load_file(str(directory / WEIGHTS_FILE)))
    model = _new_draft(config, target_model, state.get("draft_token_ids"))
    model.load_state_dict(state, strict=True)
    return _for_inference(model, target_model)


def _with_block_list(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drafts saved before blocks were a list name their one block `layer.*`; it is `layers.0.*`."""
    return {("layers.0." + k[len("layer.") :] if k.startswith("layer.") else k): v for k, v in state.items()}


def _new_draft(
    config: GlideConfig, target_model: nn.Module | None, draft_token_ids: torch.Tensor | None
) -> GlideDraft:
    embedding = None
    if config.share_target_embeddings and target_model is not None:
        embedding = borrowed_embedding(target_model)
    return GlideDraft(config, embedding, draft_token_ids)


def _for_inference(model: GlideDraft, target_model: nn.Module | None) -> GlideDraft:
    if target_model is not None:
        reference = next(target_model.parameters())
        model.to(device=reference.device, dtype=reference.dtype)
    return model.eval().requires_grad_(False)
