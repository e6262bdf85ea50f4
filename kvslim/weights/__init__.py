"""Weights kept in ggml block formats: the type table, decoders, quantized matmul and modules.

    >>> from kvslim import weights
    >>> weights.get("q4_k").block_bytes        # 144 bytes per 256 values
    >>> QuantTensor.quantize(w, weights.get("q8_0"))   # dense -> blocks, as ggml's reference
    >>> quant_linear(x, qt)                   # == F.linear(x, qt.dequantize())
"""
from ..native import block_linear as native
from .matmul import linear, quant_linear, reference_linear
from .modules import QuantEmbedding, QuantExperts, QuantLinear, parameter_count, weight_bytes, weight_type_label
from .tensor import QuantTensor, cat
from .types import TABLE, WeightType, encodable_names, from_ggml, get, names, supported_message

__all__ = ["TABLE", "WeightType", "QuantTensor", "QuantLinear", "QuantEmbedding", "QuantExperts", "cat",
           "encodable_names", "from_ggml", "get", "linear", "names", "parameter_count", "quant_linear",
           "reference_linear", "supported_message", "weight_bytes", "weight_type_label"]
