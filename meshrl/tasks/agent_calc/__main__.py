"""`python -m meshrl.tasks.agent_calc --out FILE`: write tool-arithmetic demonstrations (JSONL chat rows)
for `meshrl sft`, the warm start of recipes/agent_calc.py."""

from meshrl.tasks import demonstrations_main
from meshrl.tasks.agent_calc import TOOL_FRACTION, WARM_ROWS, demonstrations

if __name__ == "__main__":
    demonstrations_main("python -m meshrl.tasks.agent_calc", demonstrations, WARM_ROWS, TOOL_FRACTION)
