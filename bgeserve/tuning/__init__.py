"""Memory-aware auto-tuning: what a shape costs, what a worker may spend, and the probe.

``memory`` reads available memory and RSS; ``budget`` turns them into a per-worker workspace
budget; ``costmodel`` predicts a chunk's workspace and fits measurements; ``probe`` measures
shapes through a caller's run function (``synthetic`` makes one, ``child`` runs it in a
process of its own); ``runcost`` times what a run costs, which decides when padding pays;
``cache`` keeps fits across restarts; ``tuner`` decides what the engine
packs under. Nothing here imports a runtime or the engine: runs arrive as callables.
"""
