"""Real desktop tasks without Docker or a VM: the `desktop/<task>` environment (env.py) on the
desktop sandbox (the `desktop_sandbox` package beside arpo_lib: a sandboxed X desktop running
Debian applications), an OSWorld-format task suite with checkers (tasks.py, tasks/*.json).
Scripted solutions: scripted.py."""
