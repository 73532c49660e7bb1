"""Which hook options a compressor and its exchange can honour: the others are refused.

A setting the hook cannot apply as asked is refused when the state is built, with an
:class:`~gradsift.core.errors.InvalidOptionError` naming what works instead:

* ``granularity`` other than ``"bucket"`` with an exchange that runs on whole buckets;
* ``density_warmup_steps`` without a sparsifier (no ratio to warm up);
* ``error_feedback=True`` with a compressor that keeps its own residual
  (:attr:`~gradsift.compressors.base.Compressor.own_residual`: the unsent part would be sent
  from both residuals);
* ``server_feedback=True`` with a compressor whose encode is not a deterministic, stateless
  :attr:`~gradsift.compressors.base.Compressor.server_stage`, or an exchange that is not
  :attr:`~gradsift.exchanges.base.Exchange.replicated` (every rank must decode the same mean);
* ``server_feedback=True`` with an exchange that runs its own server stage
  (:attr:`~gradsift.exchanges.base.Exchange.serves`: the two-stage exchange);
* ``padding_target`` with a capacity fixed by the compressor's options (it bounds the padding
  of a capacity that follows the demand).

And when the hook is registered (:func:`refuse_sparse_gradients`), a method other than ``none``
on a model with sparse gradients: the compressors take dense gradients.
"""

from __future__ import annotations

import torch

from gradsift.compressors.base import Compressor, Sparsifier
from gradsift.compressors.registry import available_compressors, compressor_class
from gradsift.core.errors import InvalidOptionError
from gradsift.exchanges.base import Exchange
from gradsift.hook.options import HookOptions

#: Why compiled autograd's Python reducer is refused.
PYTHON_REDUCER = (
    "gradsift's hook takes DDP's buckets, but torch._dynamo.config.optimize_ddp='python_reducer' "
    "(which compiled autograd needs) calls communication hooks once per parameter with "
    "(param.grad, param); compile the forward pass only (the default optimize_ddp=True keeps "
    "DDP's buckets and gradsift's hook), or use granularity='layer' with the default reducer"
)


def refuse_incompatible(compressor: Compressor, exchange: Exchange, options: HookOptions) -> None:
    """Raise for the first setting of the module docstring that ``compressor`` and
    ``exchange`` cannot honour."""
    name = compressor.name
    if exchange.whole_bucket and options.granularity != "bucket":
        raise InvalidOptionError(f"{name} runs on whole buckets: use granularity='bucket'")
    if options.density_warmup_steps and not isinstance(compressor, Sparsifier):
        raise InvalidOptionError(f"density_warmup_steps needs a sparsifier with a ratio; {name} has none")
    if options.error_feedback and compressor.own_residual:
        raise InvalidOptionError(
            f"error_feedback=True adds the hook's residual, but {name} keeps what it did not send in its "
            "own residual, which is its error feedback: the unsent part would be sent twice; drop "
            "error_feedback="
        )
    if options.server_feedback and not compressor.server_stage:
        able = [n for n in available_compressors() if compressor_class(n).server_stage]
        raise InvalidOptionError(
            f"server_feedback=True compresses the workers' mean again on every rank, which needs a "
            f"deterministic, stateless compressor ({', '.join(able)}); {name!r} is not one"
        )
    if options.server_feedback and exchange.serves:
        raise InvalidOptionError(
            f"server_feedback=True codes the workers' mean again after an allgather; the {exchange.name} "
            "exchange runs that server stage itself, per chunk: drop server_feedback="
        )
    if options.server_feedback and not exchange.replicated:
        raise InvalidOptionError(
            f"server_feedback=True needs every rank to decode the same mean itself (exchange="
            f"'allgather'); {name!r} travels by {exchange.name!r}, which does not promise that"
        )
    if options.padding_target is not None and not compressor.adaptive_capacity:
        adaptive = [n for n in available_compressors() if compressor_class(n).adaptive_capacity]
        raise InvalidOptionError(
            f"padding_target bounds the padding of a capacity that follows the demand "
            f"({', '.join(adaptive)}); {name}'s capacity is fixed by its options"
        )


def refuse_sparse_gradients(module: torch.nn.Module, name: str) -> None:
    """Raise when ``module`` has a parameter with sparse gradients -- an ``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True``, DDP's own test for them -- and ``name`` is not
    ``none`` (stock DDP's allreduce, which gloo runs on sparse tensors as DDP does)."""
    if name == "none":
        return
    sparse = [
        f"{prefix or 'the model'} ({type(child).__name__}(sparse=True))"
        for prefix, child in module.named_modules()
        if isinstance(child, torch.nn.Embedding | torch.nn.EmbeddingBag)
        and child.sparse
        and child.weight.requires_grad
    ]
    if sparse:
        raise InvalidOptionError(
            f"{name!r} compresses dense gradients, and {', '.join(sparse)} makes sparse ones: build it "
            "with sparse=False (its gradient then dense, and compressed), or pass compressor='none'"
        )
