"""`exspec.bench`: the offline benchmark (`exspec bench`). It may use the engine and the scheduler; it holds
the target-alone reference and the equivalence classification."""
