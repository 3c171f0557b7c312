"""Rollouts, below both training and evaluation: the engine that plays episodes of a policy over
environment workers (`engine`), the rules an evaluation protocol injects into it (`rules`), and
the trajectory store, the one schema, writer and reader of a trajectory directory (`store`)."""
