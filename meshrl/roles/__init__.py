"""The services of a run, one package per role; each has a light `config.py` and a `service.py`.

The partitions and columns they share are named in meshrl/schema.py.
"""
