"""GGUF files in and out: llama.cpp's format for the same models kvslim runs.

``read_config`` / ``tensor_bytes`` / ``weight_types`` / ``file_type`` read metadata only (for the
planner); ``read_model`` gives a Hugging Face-layout state dict plus the tokenizer;
``write_gguf`` exports a checkpoint (config dict, state dict, tokenizer folder) with llama.cpp's
conventions; ``kvslim.loading.convert_hf_to_gguf`` does it for a Hugging Face folder.
``names`` holds the HF <-> GGUF name table and where each convention comes from.
"""
from .reader import file_type, read_config, read_model, tensor_bytes, weight_types
from .writer import write_gguf

__all__ = ["file_type", "read_config", "read_model", "tensor_bytes", "weight_types", "write_gguf"]
