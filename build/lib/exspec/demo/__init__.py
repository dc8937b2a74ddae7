"""`exspec.demo`: the builder of the built-in demo model pair (`exspec demo-models`)."""
