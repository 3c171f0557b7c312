"""The agent: the UI-TARS prompt and action format, and the policies that act (in process,
behind a server, scripted), with the model internals in `agent.model`."""
