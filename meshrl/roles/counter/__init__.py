"""A producer/consumer pair without models: the launcher's and data plane's tests."""
