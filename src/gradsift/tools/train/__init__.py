"""Reference trainer: Fashion-MNIST data, models, the worker loop, the launcher and
network emulation behind ``gradsift train`` and ``gradsift demo``."""
