"""Real desktop tasks without Docker or a VM: a sandboxed X desktop (sandbox.py, server.py) running
Debian applications, an OSWorld-format task suite with checkers (tasks.py, tasks/*.json), and the
`desktop/<task>` environment (env.py). Scripted solutions: scripted.py."""
