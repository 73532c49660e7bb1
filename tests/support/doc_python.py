"""How the suite runs the documentation's Python blocks: as written, on 2 gloo ranks.

Which blocks there are, and the ``not-run`` / ``continues`` markers, are defined in
``tests/support/doc_commands.py`` (:func:`~support.doc_commands.python_blocks`).

Where a block runs
------------------
A documented block is a fragment of a training script: it uses a ``model``, a ``grad`` or
a ``ddp_model`` that the reader's script has made before it. Each block runs as one
program on each of 2 ranks of its own launch of :func:`support.distributed.run_workers`
(forks of the test process's fork server: a launch costs tens of milliseconds, torch is
imported already, and every block gets fresh processes, a fresh process group and its own
hard timeout). A rank is what ``torchrun --nproc-per-node 2`` starts: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
are set, and the default gloo process group is initialised -- except for a block that
calls ``init_process_group`` itself, which gets the environment only. Both ranks work in
one fresh directory (a file rank 0 writes, the other ranks can read).

The code runs unchanged: a ``...`` line is Python's Ellipsis (it does nothing; a block
whose meaning needs work done there must write that work). Tracebacks name the page and
its line.

The prelude
-----------
The names a block reads before it binds them (:func:`free_names`) are given to it, made
by :data:`PRELUDE` on first use, so a block gets only what it takes from its context
(a ``ddp_model`` made for a block that wraps ``model`` itself would put a second DDP
reducer on the same parameters). A name that the prelude does not offer is an error
(``tests/project/test_doc_python.py`` checks every block without running it):

- ``torch``, ``dist`` (``torch.distributed``), ``DistributedDataParallel``, ``gradsift``:
  the imports of any training script.
- ``model`` and ``module``: a small classifier (8 features, 4 classes), the same on every
  rank; ``build_model``: the function that makes it; ``net``: a model with ``.blocks`` (what
  FSDP2 shards per block). In a block that reads ``training_args`` (a Hugging Face
  ``Trainer``'s), ``model`` is a tiny GPT-2 built from a config.
- ``optimizer``: SGD (learning rate 0.1) on ``model``'s parameters; ``loader``: this rank's 4
  batches of ``(inputs, labels)``; ``loss_fn``: cross-entropy.
- ``grad``: a gradient of 10,000 elements, a different one on each rank;
  ``grad_variance``: a variance for each of its elements.
- ``ddp_model``: ``model`` in ``DistributedDataParallel``; ``state``: gradsift's hook
  (``topk``, ratio 0.01) on ``ddp_model``, after 2 training steps of ``loader``; ``step``:
  its step count.
- ``path``: ``"checkpoint.pt"``; ``device``: the CPU; ``nodes``, ``gpus_per_node``: 2 and 1
  (each rank a node of one device).
- ``training_args``: ``TrainingArguments`` for 2 steps on the CPU that report nowhere and
  save nothing; ``train``: a dataset of 16 windows of 16 token ids.
"""

from __future__ import annotations

import ast
import builtins
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from support import ROOT
from support.models import make_model

FEATURES, HIDDEN, CLASSES = 8, 16, 4
BATCHES, BATCH = 4, 8
GRAD_NUMEL = 10_000
WORLD = 2
#: One block's launch: time to import a third-party package and train a few steps.
BLOCK_TIMEOUT_S = 120.0


def free_names(code: str) -> list[str]:
    """The names ``code`` reads, at its top level, before it binds them (builtins aside), in order.

    Statement by statement: an assignment's value is read before its targets are bound
    (``model, optimizer = prepare(model, optimizer)`` reads both); inside any other
    statement, a name it binds anywhere (a loop's target, an import, a function's
    parameter, a comprehension's variable) counts as bound."""
    bound, free = set(dir(builtins)), []
    for statement in ast.parse(code).body:
        stores = _bound_by(statement)
        targets: set[str] = set()
        if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in statement.targets if isinstance(statement, ast.Assign) else [statement.target]:
                targets |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        reads = [n.id for n in ast.walk(statement) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        if isinstance(statement, ast.AugAssign):
            reads += sorted(targets)
        known = bound | (stores - targets)
        for name in reads:
            if name not in known and name not in free:
                free.append(name)
        bound |= stores
    return free


def _bound_by(statement: ast.stmt) -> set[str]:
    names = set()
    for node in ast.walk(statement):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def initialises_group(code: str) -> bool:
    """Whether the block starts the process group itself (it then gets the environment only)."""
    return any(
        isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "init_process_group"
        for node in ast.walk(ast.parse(code))
    )


# -- the prelude ------------------------------------------------------------------------------
class Given:
    """The prelude's values for one block on one rank, each made on first use."""

    def __init__(self, rank: int, world: int, names: list[str]) -> None:
        self.rank, self.world, self.names = rank, world, names
        self._values: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._values:
            self._values[name] = PRELUDE[name](self)
        return self._values[name]


def _classifier() -> torch.nn.Module:
    return make_model((FEATURES, HIDDEN, CLASSES), seed=0)  # the same weights on every rank


class _BlockNet(torch.nn.Module):
    """A model made of ``.blocks`` and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(FEATURES, FEATURES), torch.nn.ReLU()) for _ in range(2)
        )
        self.head = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model(given: Given) -> torch.nn.Module:
    if "training_args" in given.names:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=32,
            n_positions=16,
            n_embd=16,
            n_layer=1,
            n_head=2,
            bos_token_id=None,
            eos_token_id=None,
        )
        return GPT2LMHeadModel(config)
    return _classifier()


def _loader(given: Given) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(given.rank)
    inputs = torch.randn(BATCHES * BATCH, FEATURES, generator=generator)
    labels = torch.randint(CLASSES, (BATCHES * BATCH,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=BATCH)


def _state(given: Given) -> Any:
    import gradsift

    ddp_model, optimizer = given["ddp_model"], given["optimizer"]
    state = gradsift.register_comm_hook(ddp_model, "topk", ratio=0.01)
    for (inputs, labels), _ in zip(given["loader"], range(2), strict=False):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp_model(inputs), labels).backward()
        optimizer.step()
    return state


def _training_args(given: Given) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir="trainer",
        max_steps=2,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
    )


def _train(given: Given) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(32, (16, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": window, "labels": window} for window in ids]


def _import(module: str, attribute: str | None = None) -> Callable[[Given], Any]:
    def given_import(given: Given) -> Any:
        import importlib

        imported = importlib.import_module(module)
        return imported if attribute is None else getattr(imported, attribute)

    return given_import


#: What a block may read without binding it (the module docstring says what each is).
PRELUDE: dict[str, Callable[[Given], Any]] = {
    "torch": _import("torch"),
    "dist": _import("torch.distributed"),
    "DistributedDataParallel": _import("torch.nn.parallel", "DistributedDataParallel"),
    "gradsift": _import("gradsift"),
    "model": _model,
    "module": _model,
    "build_model": lambda given: _classifier,
    "net": lambda given: _BlockNet(),
    "optimizer": lambda given: torch.optim.SGD(given["model"].parameters(), lr=0.1),
    "loader": _loader,
    "loss_fn": lambda given: torch.nn.functional.cross_entropy,
    "grad": lambda given: torch.randn(GRAD_NUMEL, generator=torch.Generator().manual_seed(100 + given.rank)),
    "grad_variance": lambda given: given["grad"].square() / 4,
    "ddp_model": lambda given: torch.nn.parallel.DistributedDataParallel(given["model"]),
    "state": _state,
    "step": lambda given: given["state"].step,
    "path": lambda given: "checkpoint.pt",
    "device": lambda given: torch.device("cpu"),
    "nodes": lambda given: given.world,
    "gpus_per_node": lambda given: 1,
    "training_args": _training_args,
    "train": _train,
}


# -- one block on one rank (run_workers calls this) -------------------------------------------
def run_block(
    rank: int, world: int, *, parts: list[tuple[int, str]], page: str, directory: str
) -> dict[str, Any]:
    """Run the block's ``parts`` (page line, code) in one namespace on this rank.

    Returns ``{"error": None or the traceback, "seconds": wall time}``: a failure is
    reported, not raised, so that every rank's traceback reaches the test."""
    os.chdir(directory)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    code = "".join(text for _, text in parts)
    if initialises_group(code):  # a fresh store for the block's own init_process_group("gloo")
        from support.distributed import free_port

        port = [free_port() if rank == 0 else None]
        dist.broadcast_object_list(port)
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port[0])
    names = free_names(code)
    given = Given(rank, world, names)
    started = time.monotonic()
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    unknown = [name for name in names if name not in PRELUDE]
    if unknown:
        return {
            "error": f"{page} reads {unknown}, which neither the block nor the prelude defines",
            "seconds": 0.0,
        }
    try:
        for name in names:
            namespace[name] = given[name]
        for line, text in parts:
            exec(compile("\n" * (line - 1) + text, str(ROOT / page), "exec"), namespace)
    except BaseException as error:  # the traceback from the block's first frame on
        frames = traceback.format_exception(error)
        first = next((i for i, frame in enumerate(frames) if str(ROOT / page) in frame), 1)
        return {"error": frames[0] + "".join(frames[first:]), "seconds": time.monotonic() - started}
    if dist.is_initialized():  # leave together: no rank tears its end down under a peer still at work
        try:
            dist.barrier()
        except Exception:
            return {"error": "the block ran here, but a peer did not finish it", "seconds": 0.0}
    return {"error": None, "seconds": time.monotonic() - started}
