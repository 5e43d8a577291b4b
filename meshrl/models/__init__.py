"""Small language models built locally, so tests and the demo never need a model hub or a download."""
