"""Batch-1 W4A16 GEMV configurations measured best, by GPU and "bits:group:N:K"
(written by benchmarks/quant_speed.py --sweep --write-tuned)."""

TUNED = {
    "NVIDIA H200": {
        "4:128:6144:4096": {
            "KERNEL": "gemv",
            "BLOCK_N": 128,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 16,
            "num_warps": 4,
            "num_stages": 4
        },
        "4:128:4096:4096": {
            "KERNEL": "gemv",
            "BLOCK_N": 128,
            "BLOCK_W": 8,
            "MODE": 1,
            "SPLIT_K": 8,
            "num_warps": 4,
            "num_stages": 3
        },
        "4:128:28672:4096": {
            "KERNEL": "gemv",
            "BLOCK_N": 256,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 8,
            "num_warps": 4,
            "num_stages": 4
        },
        "4:128:4096:14336": {
            "KERNEL": "gemv",
            "BLOCK_N": 128,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 16,
            "num_warps": 4,
            "num_stages": 3
        },
        "8:4096:6144:4096": {
            "KERNEL": "gemv",
            "BLOCK_N": 256,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 16,
            "num_warps": 4,
            "num_stages": 3
        },
        "8:4096:4096:4096": {
            "KERNEL": "gemv",
            "BLOCK_N": 128,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 16,
            "num_warps": 4,
            "num_stages": 4
        },
        "8:4096:28672:4096": {
            "KERNEL": "gemv",
            "BLOCK_N": 256,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 4,
            "num_warps": 4,
            "num_stages": 3
        },
        "8:14336:4096:14336": {
            "KERNEL": "gemv",
            "BLOCK_N": 128,
            "BLOCK_W": 16,
            "MODE": 2,
            "SPLIT_K": 16,
            "num_warps": 4,
            "num_stages": 3
        }
    }
}
