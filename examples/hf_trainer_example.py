"""Hugging Face ``Trainer`` with gradsift: a callback installs the hook on the Trainer's DDP model.

A tiny GPT-2 built from a config (random weights, nothing downloaded) learns a
character-level language model of a short text embedded below. ``GradsiftTrainerCallback``
registers gradsift's hook once the Trainer has wrapped the model in DDP and writes every
rank's hook state into each of the Trainer's own checkpoints, so
``resume_from_checkpoint`` continues the run exactly.

Two CPU processes::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_example.py --steps 40 --save-steps 20

Resume from one of the Trainer's checkpoints (model, optimizer, scheduler, RNG, hook state)::

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer_example.py --steps 40 \
        --resume checkpoints/checkpoint-20 --output-dir resumed

``--without-gradsift`` runs the Trainer's own DDP allreduce instead, to compare the loss
(docs/integrations.md compares the three over 300 steps).

``--compressor`` defaults to ``auto``: stock DDP while it measures the link, then the fastest
of the methods that keep AdamW's quality (``none``, ``bf16``; the 1-bit Adam method too in
runs of ``max_steps`` long enough, docs/auto.md). Name a method to compress, e.g.
``--compressor topk --ratio 0.01`` (docs/integrations.md): the callback hands the hook the
Trainer's AdamW (its default optimizer), and a sparsifier gets the frozen-variance method of
``gradsift.hook.adam`` after a dense warm-up of a tenth of the steps (docs/adam.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

from gradsift.integrations.checkpoint import parameters_agree
from gradsift.integrations.transformers import GradsiftTrainerCallback

TEXT = (
    "Data-parallel training sends every gradient to every worker at every step. "
    "Most of those numbers are tiny: a gradient is dominated by a few large elements, "
    "and the rest can wait. A sparsifier sends the large ones with their positions and "
    "keeps the remainder as a residual that is added to the next gradient, so nothing "
    "is lost, only delayed. Choosing the large elements is the expensive part: sorting "
    "millions of numbers at every step costs more than sending them on a fast link. "
    "A statistical threshold fitted to the gradient's distribution picks almost the "
    "same elements in one pass over memory. "
)
CONTEXT = 32


class CharacterWindows(Dataset):
    """Every ``CONTEXT``-character window of ``TEXT`` as token ids; the model shifts the labels."""

    def __init__(self) -> None:
        self.vocabulary = sorted(set(TEXT))
        ids = torch.tensor([self.vocabulary.index(c) for c in TEXT])
        self.windows = ids.unfold(0, CONTEXT, 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all (max_steps)")
    parser.add_argument("--save-steps", type=int, default=20, help="a Trainer checkpoint every N steps")
    parser.add_argument(
        "--compressor",
        default="auto",
        help="gradsift registry name, or auto (default): stock DDP while it measures the link, then the "
        "fastest method that keeps quality for the optimizer",
    )
    parser.add_argument(
        "--ratio", type=float, help="target density of a named sparsifier (default: the compressor's own)"
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path("checkpoints"), help="the Trainer's output_dir"
    )
    parser.add_argument("--resume", type=Path, help="a checkpoint-STEP folder to continue from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--without-gradsift", action="store_true", help="the Trainer alone, for comparison")
    parser.add_argument("--plain-error-feedback", action="store_true",
                        help="leave the Trainer's AdamW as built (error feedback only), for comparison")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    data = CharacterWindows()
    set_seed(args.seed)  # the same random weights on every rank (DDP broadcasts rank 0's anyway)
    config = GPT2Config(
        vocab_size=len(data.vocabulary), n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
        loss_type="ForCausalLM",
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=str(args.output_dir),
        max_steps=args.steps,
        save_steps=args.save_steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        ddp_find_unused_parameters=False,  # every parameter gets a gradient
        remove_unused_columns=False,
        logging_steps=args.save_steps,
        report_to="none",
        disable_tqdm=True,
        resume_from_checkpoint=None if args.resume is None else str(args.resume),
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data)
    # The gradsift part: the callback registers the hook when train() has wrapped the model in DDP,
    # saves each rank's hook state into every checkpoint and restores it on resume.
    gradsift_callback = None
    if not args.without_gradsift:
        ratio = {} if args.ratio is None else {"ratio": args.ratio}  # auto picks its own and refuses one
        gradsift_callback = GradsiftTrainerCallback(
            trainer, args.compressor, **ratio, take_optimizer=not args.plain_error_feedback
        )
        trainer.add_callback(gradsift_callback)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    agree = parameters_agree(trainer.model)
    with torch.no_grad():  # the final model's loss on a fixed batch: equal for equal weights
        batch = {
            k: torch.stack([data[i][k] for i in range(16)]).to(trainer.args.device)
            for k in ("input_ids", "labels")
        }
        loss = float(trainer.model(**batch).loss)
    if trainer.is_world_process_zero():
        summary = {"step": trainer.state.global_step, "loss": loss, "replicas_agree": agree}
        if gradsift_callback is not None:
            total = gradsift_callback.state.stats()["total"]
            summary |= {"compressor": gradsift_callback.state.compressor.name, "bytes_sent": total["bytes_sent"],
                        "dense_bytes": total["dense_bytes"], "density": total["density"]}  # fmt: skip
        print("gradsift-example", json.dumps(summary), flush=True)
    dist.barrier()  # leave together, so no rank tears the group down under a peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
