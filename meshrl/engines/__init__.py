"""Inference engines: what the inference service drives to sample completions and score sequences.

`base.py` defines the interface (`InferenceEngine`, `SamplingParams`, `Completion`) in plain Python and
torch types only, so that the service, the trainer's weight broadcast and the tests do not care which
engine runs underneath. `hf.py` implements it on Hugging Face transformers (any device, no extra
dependency); faster engines (vLLM, SGLang) implement the same interface.
"""
