"""`exspec.cli`: the `exspec` command, a thin layer that parses flags and calls one library function each."""
