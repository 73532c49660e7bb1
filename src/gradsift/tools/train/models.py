"""The models ``gradsift train`` offers: four for 1x28x28 images and 10 classes, and a
byte-level language model (:data:`DATA_OF_MODEL` says which data each trains on).

=========  ==========  ===================================================================
name       parameters  architecture
=========  ==========  ===================================================================
resnet20   272 186     CIFAR ResNet-20 (He et al. 2016): 3x3 stem, 3 stages of 3 basic
                       blocks at 16/32/64 channels (stride 2 between stages: 28->14->7),
                       BatchNorm, projection shortcuts (1x1 conv + BN) between stages
vgg        1 330 410   VGG-style: [conv32, conv32, pool, conv64, conv64, pool, conv128,
                       pool] 3x3 convs + BatchNorm + ReLU, then FC 1152->1024->10 (89% of
                       the parameters in the first FC, as in VGG: communication-heavy)
lstm       81 674      one LSTM layer (hidden 128) over the 28 image rows, written as an
                       explicit cell of two ``nn.Linear`` gate maps so per-layer hooks
                       (VGC's variance) see Linear modules; classifier on the last state
mlp        235 146     784 -> 256 -> 128 -> 10 with ReLU
mlp-wide   1 863 690   784 -> 1024 -> 1024 -> 10 with ReLU: many parameters per unit of
                       compute, for communication-bound runs (benchmarks/scaling)
gpt        478 976     GPT-style causal transformer over bytes: token + learned position
                       embeddings (width 128, context 128), 2 pre-LayerNorm blocks of
                       4-head self-attention and a 4x GELU MLP (all ``nn.Linear``), final
                       LayerNorm, untied 128->256 head; logits per position
=========  ==========  ===================================================================
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from gradsift.core.validation import check_choice
from gradsift.tools.train.data import IMAGE_SIDE, NUM_CLASSES
from gradsift.tools.train.text import CONTEXT, VOCAB_SIZE


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))`` with 3x3 convolutions."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for 1x28x28 images: 1 + 3 stages x 3 blocks x 2 + 1 = 20 weighted layers."""

    def __init__(self, widths: tuple[int, int, int] = (16, 32, 64), blocks_per_stage: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        in_channels = widths[0]
        for stage, width in enumerate(widths):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(BasicBlock(in_channels, width, stride))
                in_channels = width
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(in_channels, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


def vgg_small() -> nn.Sequential:
    """VGG-style CNN sized for CPU benchmarks (1 330 410 parameters, 89% in the first FC)."""

    def conv(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]

    return nn.Sequential(
        *conv(1, 32), *conv(32, 32), nn.MaxPool2d(2),  # 14x14
        *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),  # 7x7
        *conv(64, 128), nn.MaxPool2d(2),  # 3x3
        nn.Flatten(),
        nn.Linear(128 * 3 * 3, 1024), nn.ReLU(),
        nn.Linear(1024, NUM_CLASSES),
    )  # fmt: skip


class RowLSTM(nn.Module):
    """An LSTM reading the image one row (28 pixels) per time step.

    Gates ``[i, f, g, o] = W_x x_t + W_h h_{t-1}`` with ``W_x``, ``W_h`` plain
    ``nn.Linear`` layers; ``c_t = sigmoid(f) c_{t-1} + sigmoid(i) tanh(g)``,
    ``h_t = sigmoid(o) tanh(c_t)``; logits ``= W_out h_28``.
    """

    def __init__(self, hidden: int = 128) -> None:
        super().__init__()
        self.hidden = hidden
        self.input_gates = nn.Linear(IMAGE_SIDE, 4 * hidden)
        self.hidden_gates = nn.Linear(hidden, 4 * hidden, bias=False)
        self.head = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], IMAGE_SIDE, IMAGE_SIDE)
        h = rows.new_zeros(x.shape[0], self.hidden)
        c = torch.zeros_like(h)
        for t in range(IMAGE_SIDE):
            i, f, g, o = (self.input_gates(rows[:, t]) + self.hidden_gates(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return self.head(h)


def perceptron(*widths: int) -> nn.Sequential:
    """784 -> ``widths`` -> 10, fully connected, ReLU between the layers."""
    sizes = [IMAGE_SIDE * IMAGE_SIDE, *widths]
    layers: list[nn.Module] = [nn.Flatten()]
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], NUM_CLASSES))


def mlp() -> nn.Sequential:
    """784 -> 256 -> 128 -> 10 with ReLU."""
    return perceptron(256, 128)


def mlp_wide() -> nn.Sequential:
    """784 -> 1024 -> 1024 -> 10 with ReLU."""
    return perceptron(1024, 1024)


class CausalSelfAttention(nn.Module):
    """``proj(softmax(q k^T / sqrt(d_head) + causal mask) v)`` over ``heads`` heads, with
    ``[q, k, v] = qkv(x)``; both maps are ``nn.Linear``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))`` with a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Byte-level causal language model: ``(batch, length <= context)`` int64 tokens ->
    ``(batch, length, vocab)`` logits of the next byte at every position."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4, context: int = CONTEXT) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(VOCAB_SIZE, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(TransformerBlock(width, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB_SIZE)
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02), zero biases
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.ln_f(self.blocks(hidden)))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet20": ResNet20, "vgg": vgg_small, "lstm": RowLSTM, "mlp": mlp, "mlp-wide": mlp_wide, "gpt": TinyGPT,
}  # fmt: skip

#: The data each model trains on (see :mod:`gradsift.tools.train.datasets`).
DATA_OF_MODEL = {
    "resnet20": "fashion-mnist", "vgg": "fashion-mnist", "lstm": "fashion-mnist", "mlp": "fashion-mnist",
    "mlp-wide": "fashion-mnist", "gpt": "python-stdlib",
}  # fmt: skip


def build_model(name: str, seed: int = 0) -> nn.Module:
    """Build model ``name`` with weights drawn from ``seed`` (identical on every rank)."""
    check_choice(name, "model", tuple(MODELS))
    torch.manual_seed(seed)
    return MODELS[name]()


def parameter_count(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
