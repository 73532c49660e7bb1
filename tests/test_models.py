"""The trainer's models: shapes, sizes, determinism, and VGC-friendly LSTM structure."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsift.errors import InvalidOptionError
from gradsift.train.models import MODELS, RowLSTM, build_model, parameter_count

EXPECTED_PARAMETERS = {
    "resnet20": 272_186,
    "vgg": 1_330_410,
    "lstm": 81_674,
    "mlp": 235_146,
    "mlp-wide": 1_863_690,
}


@pytest.mark.parametrize("name", sorted(MODELS))
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
        InvalidOptionError, match="model must be one of resnet20, vgg, lstm, mlp, mlp-wide; got 'alexnet'"
    ):
        build_model("alexnet")
