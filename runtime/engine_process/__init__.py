"""The engine in its own process, and the server's link to it: the loop that drives an
`Engine` over a pipe (`loop`), the messages on that pipe (`messages`) and the HTTP process's
handle on it (`client`). Nothing here imports aiohttp; the replicas reuse it on Ray.
"""
