"""Smallest run: a producer and a consumer of integers, one device slot each.

meshrl run recipes/counter.py
"""

from meshrl.planning.recipe import Recipe, ServiceGroup
from meshrl.roles.counter.config import CounterConsumerConfig, CounterProducerConfig


def recipe() -> Recipe:
    return Recipe(
        name="counter",
        groups=(
            ServiceGroup(id="producer", config=CounterProducerConfig(count=200), devices_per_replica=1),
            ServiceGroup(id="consumer", config=CounterConsumerConfig(expect=200), devices_per_replica=1),
        ),
    )
