"""Save real gradients for the estimation study: raw and error-compensated, flat and per layer.

Trains three small models briefly on CPU, each with Top-k (ratio 0.01) and error
feedback applied to the update (so the compensated gradients carry real build-up):

* ``cnn``: conv-relu-maxpool x2 + MLP on Fashion-MNIST,
* ``lstm``: an LSTM reading the 28 image rows of Fashion-MNIST,
* ``transformer``: a 2-layer causal byte-level language model on the licence texts
  under /usr/share/common-licenses (anything on disk; no network).

For the last ``--steps`` iterations it saves, per model, two torch files in ``--out``:
``<model>-raw.pt`` (the minibatch gradient) and ``<model>-ef.pt`` (gradient + residual,
what the compressor saw), each a dict ``"<layer>@<step>" -> tensor`` where ``<layer>``
is ``flat`` (the whole model as one vector) or one of the three largest parameters.
"""

from __future__ import annotations

import argparse
import gzip
import json
import struct
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

import gradsift
from gradsift.hook.feedback import ErrorFeedback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared provenance stamp
import provenance

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
TEXT_DIR = Path("/usr/share/common-licenses")


def read_idx(path: Path) -> np.ndarray:
    """Minimal IDX reader: big-endian header (magic, dims), then unsigned bytes."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def fashion_batches(batch: int, generator: torch.Generator):
    images = torch.from_numpy(read_idx(FASHION_MNIST / "train-images-idx3-ubyte.gz").copy()).float() / 255.0
    labels = torch.from_numpy(read_idx(FASHION_MNIST / "train-labels-idx1-ubyte.gz").copy()).long()
    while True:
        pick = torch.randint(0, len(images), (batch,), generator=generator)
        yield images[pick], labels[pick]


def text_batches(batch: int, length: int, generator: torch.Generator):
    corpus = b"".join(p.read_bytes() for p in sorted(TEXT_DIR.iterdir()) if p.is_file())
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
    while True:
        start = torch.randint(0, len(data) - length - 1, (batch,), generator=generator)
        window = torch.stack([data[s : s + length + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images.unsqueeze(1)))


class RowLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(28, 128, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(images)[0][:, -1])


class TinyLM(nn.Module):
    def __init__(self, width: int = 128, length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.position = nn.Parameter(torch.randn(length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(width, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(hidden, mask=self.mask, is_causal=True))


def train_and_save(name: str, model: nn.Module, batches, args: argparse.Namespace) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    largest = sorted(((n, p) for n, p in model.named_parameters()), key=lambda item: -item[1].numel())[:3]
    compressor = gradsift.get_compressor("topk", ratio=args.ratio)
    feedback = ErrorFeedback()
    loss_fn = nn.CrossEntropyLoss()
    raw: dict[str, torch.Tensor] = {}
    compensated_out: dict[str, torch.Tensor] = {}
    total = args.warmup + args.steps
    for step in range(total):
        inputs, targets = next(batches)
        model.zero_grad()
        logits = model(inputs)
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        compensated = feedback.compensate("flat", flat)
        if step >= args.warmup:
            tag = f"@{step - args.warmup:03d}"
            for store, vector in ((raw, flat), (compensated_out, compensated)):
                store["flat" + tag] = vector.clone()
                offsets = {n: p for n, p in largest}
                start = 0
                for pname, p in model.named_parameters():
                    if pname in offsets:
                        store[pname + tag] = vector[start : start + p.numel()].clone()
                    start += p.numel()
        payload = compressor.compress(compensated)
        feedback.update("flat", compensated, payload, compressor)
        update = compressor.decompress([payload], flat.numel())
        with torch.no_grad():
            start = 0
            for p in params:
                p.add_(update[start : start + p.numel()].view_as(p), alpha=-args.lr)
                start += p.numel()
        if step % 20 == 0 or step == total - 1:
            print(f"{name} step {step:4d} loss {loss.item():.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(raw, args.out / f"{name}-raw.pt")
    torch.save(compensated_out, args.out / f"{name}-ef.pt")
    print(f"{name}: {sum(p.numel() for p in params)} parameters, wrote {args.out}/{name}-{{raw,ef}}.pt")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache/gradsift/gradients")
    parser.add_argument("--warmup", type=int, default=150, help="training steps before saving")
    parser.add_argument("--steps", type=int, default=16, help="consecutive steps saved")
    parser.add_argument("--ratio", type=float, default=0.01, help="Top-k density used in training")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD step on the sparse update")
    parser.add_argument("--models", nargs="+", default=["cnn", "lstm", "transformer"])
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    stamp = provenance.start(seeds=[0])
    generator = torch.Generator().manual_seed(0)
    builders = {
        "cnn": lambda: (ConvNet(), fashion_batches(64, generator)),
        "lstm": lambda: (RowLSTM(), fashion_batches(64, generator)),
        "transformer": lambda: (TinyLM(), text_batches(16, 64, generator)),
    }
    for name in args.models:
        model, batches = builders[name]()
        train_and_save(name, model, batches, args)
    (args.out / "provenance.json").write_text(json.dumps(stamp.finish(), indent=2) + "\n")


if __name__ == "__main__":
    main()
