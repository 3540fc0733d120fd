"""Real architectures for tests/oracles/test_models.py: tiny, float64, random init, training mode.

Hugging Face models come from `transformers` (code nobody on this project wrote); the rest
are written the way their well-known sources write them (torchvision's BasicBlock, timm's
ViT block with fused attention, torch's own nn.TransformerEncoder, Mixtral-style and
expert-choice mixture-of-experts). Each `Case` says how to build the model, which
ModuleList `checkpoint_layers` rematerializes, a batch of inputs and the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

D = torch.float64
VOCAB, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS, SEQ, BATCH = 100, 32, 4, 2, 64, 2, 8, 2
DROPOUT = 0.2
# The transformers models and the ViT stack two layers (remat regions feeding each other);
# torch's encoder and the mixture-of-experts models one, to keep tracing time down.
ONE_LAYER = 1


@dataclass(frozen=True)
class Case:
    """A model to test: `build()` returns it in float64 training mode; `layers(model)` the
    ModuleList to rematerialize; `batch(n)` a dict of n examples (leading dim n) whose
    `inputs` keys the model takes as keyword arguments; `loss(output, batch)` a scalar."""

    name: str
    build: Callable[[], nn.Module]
    layers: Callable[[nn.Module], nn.ModuleList]
    batch: Callable[[int], dict[str, torch.Tensor]]
    loss: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
    inputs: tuple[str, ...] = ("input_ids", "labels", "attention_mask")
    per_sample_batch: Callable[[int], dict[str, torch.Tensor]] | None = None  # if not `batch`

    def examples(self, n: int) -> dict[str, torch.Tensor]:
        """The batch for per-sample gradients (vmap over the leading dim)."""
        return (self.per_sample_batch or self.batch)(n)

    def model_kwargs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in batch.items() if k in self.inputs}


# ---------------------------------------------------------------- Hugging Face transformers


# use_cache=False unless asked: it is what transformers' own gradient checkpointing sets in
# training; both configs default to True (test_models tests that separately).
def _hf(config: Any, model_class: type, attn_implementation: str) -> nn.Module:
    config._attn_implementation = attn_implementation
    model = model_class(config).to(D).train()
    assert model.config._attn_implementation == attn_implementation
    return model


def llama(attn_implementation: str, use_cache: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ,
        attention_dropout=DROPOUT, use_cache=use_cache,
    )
    return _hf(config, LlamaForCausalLM, attn_implementation)


def gpt2(attn_implementation: str, use_cache: bool = False) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE, n_positions=2 * SEQ,
        resid_pdrop=DROPOUT, embd_pdrop=DROPOUT, attn_pdrop=DROPOUT, bos_token_id=0, eos_token_id=0,
        use_cache=use_cache,
    )
    return _hf(config, GPT2LMHeadModel, attn_implementation)


def bert(attn_implementation: str) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=2 * SEQ,
        hidden_dropout_prob=DROPOUT, attention_probs_dropout_prob=DROPOUT,
    )
    return _hf(config, BertForMaskedLM, attn_implementation)


def mistral(attn_implementation: str) -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ,
        attention_dropout=DROPOUT, sliding_window=SEQ // 2, use_cache=False,
    )
    return _hf(config, MistralForCausalLM, attn_implementation)


# The MoE models route with `output_router_logits=True` (their load-balancing loss, as they
# train) and router jitter on. Their experts run as "batched_mm": transformers' "eager" loop
# over `nonzero()` of the routing mask has shapes that depend on values.
def mixtral(attn_implementation: str, experts: str = "batched_mm") -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2 * SEQ,
        num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1, attention_dropout=DROPOUT,
        output_router_logits=True, router_aux_loss_coef=0.5, use_cache=False,
    )
    config._experts_implementation = experts
    return _hf(config, MixtralForCausalLM, attn_implementation)


def qwen3_moe(attn_implementation: str, experts: str = "batched_mm") -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=INTERMEDIATE // 2,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        max_position_embeddings=2 * SEQ, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        attention_dropout=DROPOUT, output_router_logits=True, router_aux_loss_coef=0.5, use_cache=False,
    )
    config._experts_implementation = experts
    return _hf(config, Qwen3MoeForCausalLM, attn_implementation)


def t5(attn_implementation: str, use_cache: bool = False) -> nn.Module:
    """An encoder-decoder: two stacks of layers (encoder.block, decoder.block)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=INTERMEDIATE, num_layers=LAYERS,
        num_decoder_layers=LAYERS, num_heads=HEADS, dropout_rate=DROPOUT, decoder_start_token_id=0, pad_token_id=0,
        use_cache=use_cache,
    )
    return _hf(config, T5ForConditionalGeneration, attn_implementation)


def bloom(attn_implementation: str) -> nn.Module:
    """Bloom's MLP runs its GeLU as a custom torch.autograd.Function in training."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, hidden_dropout=DROPOUT,
        attention_dropout=DROPOUT, use_cache=False,
    )
    return _hf(config, BloomForCausalLM, attn_implementation)




def _tokens(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "labels": ids}


def _padded_tokens(n: int) -> dict[str, torch.Tensor]:
    """Token batch with an attention mask whose last example has two padding positions."""
    batch = _tokens(n)
    mask = torch.ones(n, SEQ, dtype=torch.int64)
    mask[-1, -2:] = 0
    labels = batch["labels"].masked_fill(mask == 0, -100)
    return {**batch, "labels": labels, "attention_mask": mask}


def _hf_loss(output: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return output.loss


# BERT's padding mask goes through transformers' mask code, which branches on the mask's
# values (`.all()`), so under vmap it fails without remat too; per-sample gradients of BERT
# therefore use unpadded examples.
HF_CASES = [
    Case(f"{name}-{impl}", (lambda build=build, impl=impl: build(impl)), layers, batch, _hf_loss,
         per_sample_batch=per_sample)
    for name, build, layers, batch, per_sample in [
        ("llama", llama, lambda m: m.model.layers, _tokens, None),
        ("gpt2", gpt2, lambda m: m.transformer.h, _tokens, None),
        ("bert", bert, lambda m: m.bert.encoder.layer, _padded_tokens, _tokens),
    ]
    for impl in ("sdpa", "eager")
]

# Models remat cannot trace a layer of, each with why: their layers run replayed (as
# torch.utils.checkpoint runs them) outside torch.func transforms.
REPLAYED_CASES = [
    Case("bloom-eager", lambda: bloom("eager"), lambda m: m.transformer.h, _tokens, _hf_loss),  # GeLUFunction
    # transformers' eager experts: a Python loop over nonzero() of the routing mask
    Case("mixtral-eager-experts", lambda: mixtral("sdpa", experts="eager"), lambda m: m.model.layers, _tokens, _hf_loss),
    Case("qwen3-moe-eager-experts", lambda: qwen3_moe("sdpa", experts="eager"), lambda m: m.model.layers, _tokens, _hf_loss),
]


# ---------------------------------------------------------------- ResNet BasicBlock (torchvision)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock, as written there."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        out = self.relu(out)
        return out


def basic_block(inplanes: int = 4, planes: int = 8) -> BasicBlock:
    downsample = nn.Sequential(conv1x1(inplanes, planes, 2), nn.BatchNorm2d(planes))
    return BasicBlock(inplanes, planes, stride=2, downsample=downsample).to(D).train()


# ---------------------------------------------------------------- ViT (timm's Block, fused attention)


class Attention(nn.Module):
    """timm.models.vision_transformer.Attention with fused_attn=True."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float, proj_drop: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float) -> None:
        super().__init__()
        self.fc1, self.act, self.drop1 = nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(drop)
        self.fc2, self.drop2 = nn.Linear(hidden, dim), nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class ViTBlock(nn.Module):
    """timm.models.vision_transformer.Block (pre-norm, no layer scale, no drop path)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, drop: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, num_heads, attn_drop=drop, proj_drop=drop)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, mlp_hidden, drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch embedding (conv), class token, learned positions, blocks, norm, linear head."""

    def __init__(self, image: int = 8, patch: int = 4, channels: int = 3, dim: int = HIDDEN, classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList([ViTBlock(dim, HEADS, INTERMEDIATE, DROPOUT) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def _images(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {"images": torch.randn(n, 3, 8, 8, dtype=D, generator=g), "target": torch.randint(0, 10, (n,), generator=g)}


def _classification_loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output, batch["target"])


# ---------------------------------------------------------------- torch's nn.TransformerEncoder


class TorchEncoder(nn.Module):
    """nn.TransformerEncoder over embedded tokens, with a key padding mask, mean-pooled."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        layer = nn.TransformerEncoderLayer(
            d_model=HIDDEN, nhead=HEADS, dim_feedforward=INTERMEDIATE, dropout=0.1, batch_first=True,
            norm_first=norm_first,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=ONE_LAYER, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(input_ids), src_key_padding_mask=padding_mask)
        return self.head(h).squeeze(-1)


def _encoder_tokens(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    padding = torch.zeros(n, SEQ, dtype=torch.bool)
    padding[-1, -2:] = True
    return {"input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=g), "padding_mask": padding,
            "target": torch.randn(n, SEQ, dtype=D, generator=g)}


def _masked_regression_loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    keep = (~batch["padding_mask"]).to(output.dtype)
    return ((output - batch["target"]).pow(2) * keep).sum() / keep.sum()


# ---------------------------------------------------------------- mixture of experts


class Expert(nn.Module):
    """A SwiGLU expert as in Mixtral (w1, w3 up; w2 down), with dropout on the hidden."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.drop(F.silu(self.w1(x)) * self.w3(x)))


class _TokenChoiceRouter(nn.Module):
    """What token-choice MoEs share: experts and a router that picks `k` experts per token,
    with their probabilities renormalized."""

    def __init__(self, dim: int, hidden: int, experts: int = 3, k: int = 2) -> None:
        super().__init__()
        self.k = k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim, hidden) for _ in range(experts)])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens as rows, router probabilities, weights and indices of the chosen experts)."""
        x = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.k, dim=-1)
        return x, probs, weights / weights.sum(-1, keepdim=True), chosen


class TopKMoE(_TokenChoiceRouter):
    """Token-choice top-2 routing with static shapes: each expert runs on every token and the
    outputs are combined with a dense (tokens x experts) weight matrix built by scatter from
    the top-k indices and renormalized router probabilities."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x, probs, weights, chosen = self.route(x)
        combine = torch.zeros_like(probs).scatter(-1, chosen, weights)  # (tokens, experts), k nonzeros a row
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + combine[:, e : e + 1] * expert(x)
        return out.reshape(shape)


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing (Zhou et al., 2022) with a static capacity: each expert takes
    the `capacity` tokens with the highest router probability for it (topk over tokens),
    gathers them with index_select, runs its MLP and scatters the results back with
    index_add_, weighted by those probabilities."""

    def __init__(self, dim: int, hidden: int, experts: int = 3, capacity_factor: float = 2.0) -> None:
        super().__init__()
        self.capacity_factor = capacity_factor
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList([Expert(dim, hidden) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, experts = x.shape[0], len(self.experts)
        capacity = min(tokens, math.ceil(tokens * self.capacity_factor / experts))
        probs = torch.softmax(self.gate(x), dim=-1)
        scores, chosen = torch.topk(probs.t(), capacity, dim=-1)  # (experts, capacity)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            y = expert(x.index_select(0, chosen[e]))
            out.index_add_(0, chosen[e], y * scores[e].unsqueeze(-1))
        return out.reshape(shape)


class MixtralMoE(_TokenChoiceRouter):
    """Mixtral's MixtralSparseMoeBlock loop: `torch.where(expert_mask[e])` selects the
    tokens routed to each expert, a data-dependent shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x, _, weights, chosen = self.route(x)
        expert_mask = F.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)  # (experts, k, tokens)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(expert_mask[e])
            y = expert(x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y)
        return out.reshape(shape)


class MoEBlock(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEModel(nn.Module):
    def __init__(self, moe_class: type) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([MoEBlock(moe_class(HIDDEN, INTERMEDIATE)) for _ in range(ONE_LAYER)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lm_loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), batch["labels"].flatten())


OWN_CASES = [
    Case("vit", lambda: TinyViT().to(D).train(), lambda m: m.blocks, _images, _classification_loss, ("images",)),
    Case("torch-encoder-post-norm", lambda: TorchEncoder(norm_first=False).to(D).train(), lambda m: m.encoder.layers,
         _encoder_tokens, _masked_regression_loss, ("input_ids", "padding_mask")),
    Case("torch-encoder-pre-norm", lambda: TorchEncoder(norm_first=True).to(D).train(), lambda m: m.encoder.layers,
         _encoder_tokens, _masked_regression_loss, ("input_ids", "padding_mask")),
    Case("moe-topk-dense", lambda: MoEModel(TopKMoE).to(D).train(), lambda m: m.blocks, _tokens, _lm_loss,
         ("input_ids",)),
    Case("moe-expert-choice", lambda: MoEModel(ExpertChoiceMoE).to(D).train(), lambda m: m.blocks, _tokens, _lm_loss,
         ("input_ids",)),
]
