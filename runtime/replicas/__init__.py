"""Data parallelism (`--dp N`): several engine replicas behind one endpoint. `routing` and
`routed_prefixes` decide which replica serves each request (cache-aware, round-robin,
least-load) and import nothing of the runtime; `ray_actors` is the only module that imports
Ray; `replica_set` and `replica_client` are the front end's side.
"""
