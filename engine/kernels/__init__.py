"""Device kernels (Triton). Imported lazily by the attention backends that use them: exspec never needs triton."""
