"""Data parallelism: several engine replicas behind one endpoint. `routing` decides which
replica serves each request (cache-aware, round-robin, least-load); it imports nothing of the
runtime, so a front end can route without loading a model.
"""
