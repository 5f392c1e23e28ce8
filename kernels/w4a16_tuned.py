"""W4A16 configurations measured best at batch 1, 2 and 4, by GPU and "bits:group:N:K:m<rows>"
(written by benchmarks/quant_speed.py --sweep --write-tuned; empty until that has run on the
GPU: the entries measured for the earlier two-launch GEMV were dropped with it)."""

TUNED: dict = {}
