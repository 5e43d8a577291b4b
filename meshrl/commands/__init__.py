"""The `meshrl` subcommands that sit above the roles (they use a role's pieces outside a run): `eval`,
and `sft` on chat data. Those that only start or watch a run live with what they drive
(meshrl/runtime/run.py, observe/)."""
