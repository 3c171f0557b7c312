"""The ground floor: config, the registries of every extension point, run-directory layout,
records, tracking, seeds and logging.

Nothing here imports anything else of `arpo_lib` (a registry imports the module that fills it by
name, when first read): every other package builds on these.
"""
