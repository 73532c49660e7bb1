"""Gradient compressors: one module per family, looked up by name in the registry."""

from gradsift.compressors.base import Compressor, Payload, Sparsifier, scatter_mean, target_count
from gradsift.compressors.registry import available_compressors, compressor_class, get_compressor

__all__ = [
    "Compressor",
    "Payload",
    "Sparsifier",
    "available_compressors",
    "compressor_class",
    "get_compressor",
    "scatter_mean",
    "target_count",
]
