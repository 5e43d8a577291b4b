"""Tasks with programmatic rewards: prompts, reference answers and a scoring function per task."""
