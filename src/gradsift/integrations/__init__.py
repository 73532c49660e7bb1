"""Glue between gradsift's DDP hook and the tools users already run.

- :mod:`gradsift.integrations.telemetry`: hook statistics as flat ``name -> number`` scalars.
- :mod:`gradsift.integrations.tensorboard`: those scalars into a TensorBoard ``SummaryWriter``
  (extra ``tensorboard``).
- :mod:`gradsift.integrations.lightning`: a PyTorch Lightning callback that installs the hook,
  logs its statistics to the trainer's logger and checkpoints its state (extra ``lightning``).

Each optional package is imported only inside the module that needs it.
"""
