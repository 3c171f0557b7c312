"""Environments in worker processes: `worker` (one environment in its own process, or in another
interpreter such as OSWorld's, answering commands over a pipe; crashes and timeouts become
EnvError), `pool` (local workers) and `ray_pool` (workers as Ray actors on a cluster's CPU nodes),
both on `base.PoolBase`. No environment family lives here: the families are the other folders of
arpo_lib/envs."""
