"""The ground floor: config, run-directory layout, records, tracking, seeds and logging.

Nothing here imports anything else of `arpo_lib`: every other package builds on these.
"""
