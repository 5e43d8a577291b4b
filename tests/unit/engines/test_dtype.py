"""Engines that do not load through from_pretrained (vLLM, SGLang) read the dtype under either key."""

from __future__ import annotations

import torch

from meshrl.engines.base import dtype_name


def test_dtype_is_read_under_either_key_and_spelled_plainly():
    assert dtype_name({"dtype": "bfloat16"}, "float32") == "bfloat16"  # the key InferenceConfig documents
    assert dtype_name({"torch_dtype": torch.bfloat16}, "float32") == "bfloat16"
    assert dtype_name({"trust_remote_code": True}, "float32") == "float32"
    assert dtype_name(None, "auto") == "auto"
