"""The trainer's models: shapes, sizes, determinism, VGC-friendly LSTM structure, causal LM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsift.core.errors import InvalidOptionError
from gradsift.tools.train.models import DATA_OF_MODEL, MODELS, RowLSTM, build_model, parameter_count
from gradsift.tools.train.text import CONTEXT, VOCAB_SIZE

EXPECTED_PARAMETERS = {
    "resnet20": 272_186,
    "vgg": 1_330_410,
    "lstm": 81_674,
    "mlp": 235_146,
    "mlp-wide": 1_863_690,
    "gpt": 478_976,
}
IMAGE_MODELS = sorted(name for name, data in DATA_OF_MODEL.items() if data == "fashion-mnist")


def test_every_model_has_its_data() -> None:
    assert set(DATA_OF_MODEL) == set(MODELS)
    assert DATA_OF_MODEL["gpt"] == "python-stdlib"


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_models_map_images_to_ten_logits_with_documented_size(name: str) -> None:
    model = build_model(name, seed=0)
    logits = model(torch.randn(3, 1, 28, 28))
    assert logits.shape == (3, 10)
    assert parameter_count(model) == EXPECTED_PARAMETERS[name]
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = build_model("vgg", seed=1), build_model("vgg", seed=1), build_model("vgg", seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_resnet20_has_twenty_weighted_layers_on_the_main_path() -> None:
    model = build_model("resnet20")
    convs = [m for name, m in model.named_modules() if isinstance(m, nn.Conv2d) and "shortcut" not in name]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 20
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_lstm_is_an_explicit_cell_of_linear_gates() -> None:
    model = build_model("lstm")
    assert not any(isinstance(m, nn.LSTM | nn.LSTMCell | nn.RNNBase) for m in model.modules())
    assert {type(m) for m in model.children()} == {nn.Linear}
    # reading rows: the output depends on the last row, and on the first row through the recurrence
    x = torch.randn(2, 1, 28, 28)
    base = model(x)
    for row in (0, 27):
        changed = x.clone()
        changed[:, 0, row] += 1.0
        assert not torch.allclose(model(changed), base)


def test_lstm_matches_torch_lstm_cell_equations() -> None:
    model = RowLSTM(hidden=8)
    cell = nn.LSTMCell(28, 8)
    with torch.no_grad():
        cell.weight_ih.copy_(model.input_gates.weight)
        cell.bias_ih.copy_(model.input_gates.bias)
        cell.weight_hh.copy_(model.hidden_gates.weight)
        cell.bias_hh.zero_()
    x = torch.randn(4, 1, 28, 28)
    h = c = torch.zeros(4, 8)
    for t in range(28):
        h, c = cell(x[:, 0, t], (h, c))
    torch.testing.assert_close(model(x), model.head(h))


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(
        InvalidOptionError,
        match="model must be one of resnet20, vgg, lstm, mlp, mlp-wide, gpt; got 'alexnet'",
    ):
        build_model("alexnet")


def test_gpt_maps_bytes_to_next_byte_logits_with_documented_size() -> None:
    model = build_model("gpt", seed=0)
    tokens = torch.randint(0, VOCAB_SIZE, (2, CONTEXT))
    logits = model(tokens)
    assert logits.shape == (2, CONTEXT, VOCAB_SIZE)
    assert parameter_count(model) == EXPECTED_PARAMETERS["gpt"]
    logits.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # a shorter window works too (positions are embedded up to the context)
    assert model(tokens[:, :7]).shape == (2, 7, VOCAB_SIZE)


def test_gpt_is_causal() -> None:
    model = build_model("gpt", seed=0).eval()
    tokens = torch.randint(0, VOCAB_SIZE, (1, 32))
    changed = tokens.clone()
    changed[0, 20] = (changed[0, 20] + 1) % VOCAB_SIZE
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20])  # the past does not see the future
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_gpt_weights_are_linear_layers_except_embeddings_and_norms() -> None:
    model = build_model("gpt")
    kinds = {type(m) for m in model.modules() if any(True for _ in m.parameters(recurse=False))}
    assert kinds == {nn.Embedding, nn.LayerNorm, nn.Linear}
    linear = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    assert linear / parameter_count(model) > 0.89  # VGC's variance hooks cover 89% of the weights
