"""W4A16 configurations measured best at batch 1, 2 and 4, by GPU and "bits:group:N:K:m<rows>",
and the fp8 GEMV's by "fp8:N:K:m<rows>"
(written by benchmarks/quant_speed.py --sweep --write-tuned)."""

TUNED = {
    "NVIDIA H200": {
        "4:128:6144:4096:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "4:128:6144:4096:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "4:128:6144:4096:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 4,
            "num_warps": 2
        },
        "4:128:4096:4096:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "4:128:4096:4096:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "4:128:4096:4096:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "4:128:28672:4096:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "4:128:28672:4096:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 4,
            "num_warps": 2
        },
        "4:128:28672:4096:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 1,
            "num_warps": 2
        },
        "4:128:4096:14336:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "4:128:4096:14336:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "4:128:4096:14336:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "8:4096:6144:4096:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "8:4096:6144:4096:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "8:4096:6144:4096:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 4,
            "num_warps": 2
        },
        "8:4096:4096:4096:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "8:4096:4096:4096:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "8:4096:4096:4096:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "8:4096:28672:4096:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 4,
            "num_warps": 2
        },
        "8:4096:28672:4096:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 4,
            "num_warps": 2
        },
        "8:4096:28672:4096:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 1,
            "num_warps": 2
        },
        "8:14336:4096:14336:m1": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "8:14336:4096:14336:m2": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 16,
            "num_warps": 2
        },
        "8:14336:4096:14336:m4": {
            "KERNEL": "gemv",
            "BLOCK_N": 64,
            "BLOCK_W": 16,
            "SPLIT_K": 8,
            "num_warps": 2
        },
        "fp8:6144:4096:m1": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:6144:4096:m2": {
            "BLOCK_N": 16,
            "BLOCK_K": 256,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:6144:4096:m4": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:4096:4096:m1": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:4096:4096:m2": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:4096:4096:m4": {
            "BLOCK_N": 16,
            "BLOCK_K": 256,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:28672:4096:m1": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:28672:4096:m2": {
            "BLOCK_N": 16,
            "BLOCK_K": 256,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:28672:4096:m4": {
            "BLOCK_N": 16,
            "BLOCK_K": 256,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:4096:14336:m1": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 8,
            "num_warps": 4
        },
        "fp8:4096:14336:m2": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        },
        "fp8:4096:14336:m4": {
            "BLOCK_N": 8,
            "BLOCK_K": 512,
            "SPLIT_K": 1,
            "num_warps": 4
        }
    }
}
