"""The serving process: ``cachesvc serve`` and what it wires.

``server`` (the process: startup, uvicorn, signals, drain) -> ``app`` (the Litestar app alone)
and ``default_model`` (which model a model-less serve starts with) -> ``model_loading`` (the
startup runtime, the engine factory, the model pool) and ``bundle_watch`` (a loaded bundle found
corrupt leaves service) -> ``entry`` (config -> the opened cache) and ``served_models`` (served
name -> ready bundle: the pool's model source) -> ``build_progress`` (a build's progress for a
person). Each floor imports only the floors below it (an import-linter contract).
"""
