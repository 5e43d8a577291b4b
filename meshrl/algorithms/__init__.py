"""The RL math of post-training as pure functions on tensors: advantages, policy losses, batch filters.

Kept apart from the services so that every estimator and loss can be read against its paper and unit
tested on hand-computed numbers, with no model, data plane or process in the way. Nothing here keeps
state, talks to other processes or knows about devices beyond the tensors it is given.
"""
