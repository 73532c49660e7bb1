"""Gradient compressors: one module per family, looked up by name in the registry."""

from gradsift.compressors.base import Compressor, Sparsifier, scatter_mean, target_count
from gradsift.compressors.registry import (
    available_compressors,
    compressor_class,
    get_compressor,
    register_compressor,
)
from gradsift.core.payload import Payload

__all__ = [
    "Compressor",
    "Payload",
    "Sparsifier",
    "available_compressors",
    "compressor_class",
    "get_compressor",
    "register_compressor",
    "scatter_mean",
    "target_count",
]
