"""What a model is, before any weights: the architecture read from `config.json`
(`model_config`) and the families we run, with the switches each needs (`families`). It imports
nothing else of the runtime, so the layers, the loader and the engine can all read it.
"""
