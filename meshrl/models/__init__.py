"""Models: small ones built locally, so tests and the demo never need a model hub or a download
(`tiny.py`), and where a recipe's models are on disk, hub ids and GGUF files included (`hub.py`)."""
