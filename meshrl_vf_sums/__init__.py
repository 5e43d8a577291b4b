"""The verifiers v1 taskset `meshrl-vf-sums` (meshrl/tasks/vf_sums.py) under the name v1 imports it by.

v1 resolves a taskset id to a top-level module (`meshrl-vf-sums` -> `meshrl_vf_sums`) that exports
its `Taskset` (and here its `Harness`, which makes it the taskset's default) in `__all__`; a dotted
path is not resolved. Installing meshrl installs this package, so the id resolves wherever meshrl is
installed: in a run's agents and rollout services, and in verifiers' own tools (`vf-eval`).
"""

from meshrl.tasks.vf_sums import SumsHarness, SumsTaskset

__all__ = ["SumsHarness", "SumsTaskset"]
