"""OSWorld: desktop tasks in desktop_env VMs.

- `env`: `OSWorldEnv`, the adapter around `desktop_env.DesktopEnv` (`make_env("osworld/<id>")`)
- `tasks`: the ARPO fork's task data (fetched once, validated, cached) and the task sets
- `fetch`: generic safe download / extract / hash / swap-into-place
- `fake`: `FakeDesktopEnv`, desktop-env's signatures without Docker, for tests and dry runs

Evaluations written in OSWorld's own result layout: `arpo_lib.evaluation.osworld_export` (it reads
our trajectories through the rollout store, a layer above this package).

Standard library (and PIL) only at import: environment workers run in OSWorld's own interpreter.
"""
