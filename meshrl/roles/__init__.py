"""The services of a run, one module (or package) per role."""
