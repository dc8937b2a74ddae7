"""`exspec.bench`: the offline benchmark (`exspec bench`). It may use the engine and the scheduler.

- runner.py: the throughput benchmark (methods, timing, equivalence with the target alone at B = 1)
- equivalence.py: near-tie classification of divergences by the target's top-2 logit gap
- forward.py: `--mode forward`, one target forward through `ModelRunner.extend`, consecutive vs scattered slots
- synthetic.py: `--synthetic NAME`, random Llama-shaped pairs with a draft that agrees at a measured rate
- report.py: results.json / results.md / throughput.png (the plot only with matplotlib)
- command.py: what `exspec bench` runs once its flags are parsed
"""
