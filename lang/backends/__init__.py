"""Where a program's requests go: the in-process engine, our server, or any
OpenAI-compatible server. All three implement `Backend` (backend.py)."""
