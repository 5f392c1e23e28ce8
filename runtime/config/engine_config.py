"""The engine's one validated, frozen configuration.

CLI parsing lives in the entry point; this module only checks values, so that a bad setting
fails when the engine is built, naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The spellings vLLM, SGLang and transformers users type.
DTYPE_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32",
                 "fp32": "float32"}
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
SCHEDULE_POLICIES = ("lpm", "fcfs")
PROGRAM_POLICIES = ("plas", "fcfs")
OVERLAP_MODES = ("auto", "on", "off")
DISTRIBUTED_EXECUTORS = ("mp", "ray")
SPECULATIVE_METHODS = ("ngram", "draft")
GRAMMAR_BACKENDS = ("llguidance", "outlines")
# A quantization method, or "none": float weights (a GGUF model's blocks dequantized).
QUANTIZATIONS = ("fp8", "int8", "awq", "gptq", "gguf", "none")
# How the KV cache stores K and V (radixlm.runtime.attention.kv_cache.KV_CACHE_DTYPES).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class EngineConfig:
    # A model folder, a .gguf file, a short name (e.g. "smollm2-135m-instruct") or a Hub id.
    # None means the embedded default model.
    model: str | None = None
    # A Hub revision (branch, tag or commit) for a model fetched from the Hub.
    revision: str | None = None
    # Another tokenizer (a folder or Hub id) than the model's own.
    tokenizer: str | None = None
    # A chat template (Jinja text, or a file holding it) instead of the tokenizer's own.
    chat_template: str | None = None
    load_format: str = "auto"
    # float32, bfloat16 or float16 (or bf16, half, fp16, fp32); "auto": float32 on CPU,
    # bfloat16 on CUDA; on CPU bfloat16 for quantized weights (a GGUF model, a quantized
    # checkpoint, or `quantization` asked for; their CPU kernels take bfloat16), else float32.
    dtype: str = "auto"
    device: str = "auto"  # cuda when available, else cpu
    seed: int = 0  # seeds requests that have no seed of their own, and dummy weights
    # Quantized decoder linears: fp8 (W8A8) or int8 (weight-only) quantize any checkpoint on
    # load; awq and gptq need such a checkpoint; gguf runs a GGUF model's blocks as they are
    # (CPU, bfloat16, tp_size 1); none: float weights, a GGUF model's blocks dequantized.
    # None: what the checkpoint declares (a GGUF model: gguf where it can run, else none).
    quantization: str | None = None
    # Paged KV memory. The pool holds `max_total_tokens` token slots in pages of `page_size`;
    # when it is None the pool is sized from `kv_cache_memory_fraction` of the free memory.
    page_size: int = 16
    max_total_tokens: int | None = None
    # How the cache stores K and V: "auto" (the model's dtype), or float8 ("fp8_e4m3",
    # "fp8_e5m2"): half the bytes of bfloat16, so twice the tokens fit and decode reads half
    # the KV, at a small cost in accuracy (docs/performance.md). Scales: the checkpoint's
    # k_scale / v_scale per layer where it has them, else 1.0.
    kv_cache_dtype: str = "auto"
    # Decode attention over an fp8_e4m3 cache multiplies q.k in float8 on the tensor cores
    # (CUDA, triton backend): each head's query is rounded to e4m3 and K is never widened.
    # Meant for faster batched decode (its speed is not yet measured); a small cost in
    # accuracy (docs/attention.md, "Float8 q.k").
    fp8_attention: bool = False
    kv_cache_memory_fraction: float = 0.5
    # Longest prompt + completion; None takes the model's own limit, clipped to the pool.
    max_model_len: int | None = None
    # Continuous batching bounds for one step.
    max_running_requests: int = 256
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int = 512
    # torch, triton or flashinfer; "auto": torch on CPU, our Triton kernels on CUDA (faster
    # than FlashInfer's decode on the shapes we measured; docs/performance.md).
    attention_backend: str = "auto"
    # Decode-only steps replay CUDA graphs captured per padded batch size (CUDA, triton or
    # flashinfer attention); this turns that off and runs every step eagerly.
    disable_cuda_graph: bool = False
    # On CPU, bfloat16 decode steps of Llama-family models run the layer stack in one C++ call
    # (compiled on first use, cached; docs/performance.md); this keeps them on the eager path.
    disable_cpu_kernel: bool = False
    # Overlap scheduling: while the device runs a decode step, the host prepares and launches
    # the next one (feeding it the tokens still on the device), then post-processes the
    # first. "auto" turns it on for CUDA, where the device runs ahead of the host; on CPU the
    # forward is synchronous and there is nothing to hide.
    overlap_schedule: str = "auto"
    # Speculative decoding: "ngram" (prompt lookup) or "draft" (`draft_model`, a small model
    # with the target's tokenizer) proposes up to `num_speculative_tokens` tokens per decode
    # step, verified losslessly in one target forward. Turns overlap scheduling off.
    speculative: str | None = None
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    # Per request, draft fewer tokens while few are accepted (at most num_speculative_tokens).
    speculative_adaptive: bool = True
    # Tensor parallelism: the model and the KV pool are sharded over `tp_size` processes (this
    # one is rank 0; see runtime/parallel/sharded.py). A collective that waits longer than
    # `tp_timeout` seconds (a lost rank) fails the running requests instead of hanging.
    tp_size: int = 1
    tp_timeout: float = 60.0
    # Pipeline parallelism: the layers are split into `pp_size` consecutive stages, each held
    # by `tp_size` ranks (tp_size x pp_size processes; runtime/parallel/pipeline.py). Stage 0
    # (this process's) also holds the embedding and the output head and samples; each stage
    # holds its own layers' KV. Up to `pp_size` batches of different requests are in flight,
    # one per stage, so no stage waits for another's step to end.
    pp_size: int = 1
    # Sequence parallelism for prefill: `sp_size` processes each hold the whole model; a
    # step of at least `sp_min_tokens` tokens (a long prompt's prefill chunk) is split by its
    # rows across them, each computing its rows and exchanging K and V with the others at
    # every layer (runtime/parallel/sequence.py). Shorter steps (decode) run on this process
    # alone, which then hands their K and V to the others.
    sp_size: int = 1
    sp_min_tokens: int = 256
    # How the other ranks (tp_size x pp_size x sp_size - 1 of them) start: "mp", processes on
    # this machine; "ray", actors that Ray places on its cluster's nodes (RAY_ADDRESS, else a
    # local cluster; needs radixlm[ray]; runtime/parallel/ray_workers.py).
    distributed_executor_backend: str = "mp"
    # The all-reduce of activations on CUDA: "symmetric" (PyTorch symmetric memory over
    # NVLink: each rank reads its peers' buffers; lower latency than NCCL for decode-sized
    # tensors, used up to the decode graphs' largest batch), "nccl", or "auto" (symmetric
    # where the GPUs support it, else NCCL). Larger tensors (prefill) always use NCCL.
    tp_all_reduce: str = "auto"
    # Turn the prefix cache (RadixAttention) off: every prompt is computed in full.
    disable_radix_cache: bool = False
    # A disk tier under the prefix cache: every page the cache takes is also written to a
    # file in this folder (in a folder per model identity), and a prompt whose prefix goes on
    # past what the cache holds loads the pages the disk has instead of computing them; the
    # files outlive the process, so a restarted engine finds its prefixes again. None: no
    # disk tier.
    disk_cache_dir: str | None = None
    # The disk tier's size bound, in GiB: least recently used files are removed past it.
    disk_cache_gb: float = 16.0
    # A host-memory tier under the prefix cache (above the disk tier, if any), in GiB: every
    # page the cache takes is also copied to host memory (pinned, on its own CUDA stream on a
    # GPU), and a prompt whose prefix goes on past what the device holds loads it back. Meant
    # for GPUs, whose KV pool is small; allocated at start. 0: no host tier.
    host_cache_gb: float = 0.0
    # The waiting-queue order: "lpm" serves the longest cached prefix first and lets requests
    # that share an uncached prefix wait for it; "fcfs" serves in arrival order.
    schedule_policy: str = "lpm"
    # Across programs (requests that name one, Request.program_id): "plas" admits first the
    # requests of programs that have had the least service so far (tokens computed for them,
    # along a program's longest chain of calls, so forked branches count as one; a request
    # without a program counts as a program of its own), in levels that double, and raises a
    # request one level for every couple of seconds it waits, so none starves; with every
    # running slot taken, a much less served program's request preempts the most served
    # one's. "fcfs" ignores programs. Priority and the fair share inside an HTTP request come
    # first.
    program_policy: str = "fcfs"
    # After a request of a program ends, its prefix (prompt and output) stays pinned this many
    # seconds, so the program's next call (after its tool ran) hits the cache even under
    # memory pressure; the next call's end moves the pin, the program's end (release_program)
    # drops it. Pins count against lease_memory_fraction. 0 turns it off.
    program_ttl: float = 10.0
    # Prefixes pinned by leases (a program's fork, a server client's pin) may hold at most
    # this fraction of the KV pool; further pins are refused and the program runs unpinned.
    lease_memory_fraction: float = 0.25
    # Structured output (regex / json_schema / ebnf / json_object). llguidance (the default)
    # compiles in milliseconds within its parser limits; outlines-core builds a token automaton
    # up front in worker processes, and has no context-free grammars (ebnf). A compile that
    # takes longer than the timeout (seconds) or more memory than the limit (GiB, 0 = none)
    # fails only its own request.
    grammar_backend: str = "llguidance"
    grammar_compile_timeout: float = 30.0
    grammar_compile_workers: int = 2
    grammar_compile_max_memory_gb: float = 4.0
    # Compiled grammars kept (LRU): at most this many, and for outlines-core (whose cache the
    # engines of a process share) this much memory: an index for a large JSON schema can take
    # hundreds of MB.
    grammar_cache_size: int = 256
    grammar_cache_memory_gb: float = 1.0
    json_max_whitespace: int = 1  # spaces allowed between JSON tokens (0: compact JSON)
    # Append the text a grammar forces (`{"name": "`) without sampling it token by token.
    # None: on, unless decode steps replay CUDA graphs: forced text makes a step a multi-token
    # one, which runs the whole batch without its graph (an H200 at batch 64 ran constrained
    # decoding at 0.59x of unconstrained with it, 0.96x without).
    enable_jump_forward: bool | None = None
    # LoRA adapters to serve over the base model, as NAME=PATH (a PEFT adapter folder, or a
    # llama.cpp GGUF adapter file); requests pick one by name (Engine.generate(lora=...),
    # `model` on the OpenAI routes, `lora_path` on /generate). See docs/lora.md.
    lora_modules: tuple[str, ...] | None = None
    # The modules adapters may train, as PEFT names them (q_proj, k_proj, v_proj, o_proj,
    # gate_proj, up_proj, down_proj, or all): only these layers hold adapter slots and run
    # updates. None: those the lora_modules adapters train, or every one with
    # allow_runtime_lora_loading. A runtime-loaded adapter training others is refused.
    lora_target_modules: tuple[str, ...] | None = None
    # Adapters one batch may mix (the slots on the device; more wait for a slot).
    max_loras_per_batch: int = 8
    # The largest adapter rank served (slots are sized for it). None: the largest rank of
    # lora_modules, or 64 when adapters are only loaded at runtime.
    max_lora_rank: int | None = None
    # Adapters kept loaded on the host (lora_modules and runtime loads together).
    max_loaded_loras: int = 64
    # Let adapters be loaded and unloaded while serving (Engine.load_lora, the server's
    # /v1/load_lora_adapter and /v1/unload_lora_adapter). Also serves LoRA without
    # lora_modules.
    allow_runtime_lora_loading: bool = False
    # Deterministic inference: on CUDA a request's greedy tokens and logprobs (and a seeded
    # request's samples) are the same bits whatever else shares its steps, however its prompt
    # is chunked and whatever the prefix cache holds: batch-invariant matmuls and attention,
    # at some cost in speed (docs/deterministic.md). Needs the triton attention backend; with
    # tp_size > 1 the ranks' partial sums are gathered and added in rank order. On CPU it
    # changes nothing: the CPU path is deterministic already.
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a string or None, got {type(self.model).__name__}")
        _one_of(self.load_format, LOAD_FORMATS, "load_format")
        if self.quantization is not None:
            _one_of(self.quantization, QUANTIZATIONS, "quantization")
        if isinstance(self.dtype, str) and self.dtype.lower() in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype.lower()])
        _one_of(self.dtype, ("auto", *DTYPES), "dtype")
        _one_of(self.attention_backend, ATTENTION_BACKENDS, "attention_backend")
        _one_of(self.kv_cache_dtype, KV_CACHE_DTYPES, "kv_cache_dtype")
        _one_of(self.schedule_policy, SCHEDULE_POLICIES, "schedule_policy")
        _one_of(self.program_policy, PROGRAM_POLICIES, "program_policy")
        _one_of(self.overlap_schedule, OVERLAP_MODES, "overlap_schedule")
        self._check_speculative_options()
        _positive_int(self.tp_size, "tp_size")
        _positive_int(self.pp_size, "pp_size")
        _positive_int(self.sp_size, "sp_size")
        _positive_int(self.sp_min_tokens, "sp_min_tokens")
        _one_of(self.distributed_executor_backend, DISTRIBUTED_EXECUTORS,
                "distributed_executor_backend")
        self._check_pipeline_options()
        _one_of(self.tp_all_reduce, ("auto", "symmetric", "nccl"), "tp_all_reduce")
        if (isinstance(self.tp_timeout, bool) or not isinstance(self.tp_timeout, (int, float))
                or not self.tp_timeout > 0):
            raise ValueError(f"tp_timeout must be a positive number of seconds, "
                             f"got {self.tp_timeout!r}")
        for name in ("disable_radix_cache", "disable_cuda_graph", "disable_cpu_kernel",
                     "deterministic", "fp8_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("page_size", "max_running_requests", "max_num_batched_tokens",
                     "chunked_prefill_size"):
            _positive_int(getattr(self, name), name)
        for name in ("max_total_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                _positive_int(getattr(self, name), name)
        if not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1), "
                             f"got {self.kv_cache_memory_fraction}")
        if not 0 <= self.lease_memory_fraction <= 1:
            raise ValueError("lease_memory_fraction must be in [0, 1], "
                             f"got {self.lease_memory_fraction}")
        if isinstance(self.program_ttl, bool) or not isinstance(self.program_ttl, (int, float)) \
                or not 0 <= self.program_ttl <= 3600:
            raise ValueError(f"program_ttl must be in [0, 3600] seconds, got {self.program_ttl}")
        self._check_grammar_options()
        self._check_cache_tier_options()
        self._check_lora_options()
        if self.deterministic and self.attention_backend == "flashinfer":
            raise ValueError("attention_backend 'flashinfer' cannot run deterministic=True: its "
                             "kernels split a query's keys by batch and chunk; use 'triton' "
                             "(or 'auto')")
        if self.fp8_attention:
            self._check_fp8_attention()
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must hold at least one "
                             f"page of {self.page_size} tokens")

    def _check_pipeline_options(self) -> None:
        if self.sp_size > 1:
            _refuse_with("sp_size > 1", (
                (self.tp_size > 1 or self.pp_size > 1, "tp_size or pp_size > 1: "
                 "sequence-parallel ranks each hold the whole model"),
                (self.lora_enabled, "lora_modules / allow_runtime_lora_loading: adapters are "
                 "not held by the other ranks"),
                (self.overlap_schedule == "on", "overlap_schedule='on': each step's K and V "
                 "reach the other ranks before the next")))
        if self.pp_size > 1:
            _refuse_with("pp_size > 1", (
                (self.speculative is not None, "speculative: a verify step needs the last "
                 "stage's result before the next step is planned"),
                (self.lora_enabled, "lora_modules / allow_runtime_lora_loading: adapters are "
                 "not split over stages yet"),
                (self.overlap_schedule == "on", "overlap_schedule='on': the pipeline keeps its "
                 "own steps in flight")))

    def _check_cache_tier_options(self) -> None:
        if (isinstance(self.host_cache_gb, bool)
                or not isinstance(self.host_cache_gb, (int, float))
                or not 0 <= self.host_cache_gb < float("inf")):
            raise ValueError(f"host_cache_gb must be a number of GiB >= 0, "
                             f"got {self.host_cache_gb!r}")
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, str) or not self.disk_cache_dir:
                raise ValueError("disk_cache_dir must be a folder's path")
            if (isinstance(self.disk_cache_gb, bool) or not isinstance(self.disk_cache_gb,
                                                                       (int, float))
                    or not self.disk_cache_gb > 0):
                raise ValueError(f"disk_cache_gb must be a positive number of GiB, "
                                 f"got {self.disk_cache_gb!r}")
        for name, on in (("disk_cache_dir", self.disk_cache_dir is not None),
                         ("host_cache_gb", self.host_cache_gb > 0)):
            if on:
                _refuse_with(name, (
                    (self.disable_radix_cache, "disable_radix_cache: it is the prefix cache's "
                     "lower tier"),
                    (self.pp_size > 1, "pp_size > 1: each stage holds its layers' KV"),
                    (self.sp_size > 1, "sp_size > 1: loaded pages would reach rank 0's KV "
                     "only"),
                    (self.speculative is not None, "speculative decoding: the draft model's "
                     "KV is not stored")))

    def _check_fp8_attention(self) -> None:
        if self.kv_cache_dtype != "fp8_e4m3":
            raise ValueError("fp8_attention multiplies the query by an e4m3 cache's keys: it "
                             f"needs kv_cache_dtype 'fp8_e4m3', not {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "triton"):
            raise ValueError("fp8_attention runs in our Triton decode kernel: it needs "
                             f"attention_backend 'triton' (or 'auto'), not "
                             f"{self.attention_backend!r}")
        if self.deterministic:
            raise ValueError("fp8_attention is not available with deterministic=True: the "
                             "batch-invariant decode kernel widens the cache")

    def deterministic_on(self, device: torch.device) -> bool:
        """Whether an engine on `device` runs the batch-invariant kernels: deterministic=True
        on CUDA. On the CPU the option is accepted and changes nothing (its kernels already
        compute a row the same way in every batch)."""
        return self.deterministic and device.type == "cuda"

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or self.allow_runtime_lora_loading

    def lora_paths(self) -> dict[str, str]:
        """{name: folder} of lora_modules."""
        paths: dict[str, str] = {}
        for entry in self.lora_modules or ():
            name, sep, path = entry.partition("=") if isinstance(entry, str) else ("", "", "")
            if not sep or not name or not path:
                raise ValueError(f"lora_modules: each entry is NAME=PATH, got {entry!r}")
            if name in paths:
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
            paths[name] = path
        return paths

    def _check_lora_options(self) -> None:
        for name in ("lora_modules", "lora_target_modules"):
            value = getattr(self, name)
            if isinstance(value, (str, list)):  # one entry, or a list from Python
                object.__setattr__(self, name, (value,) if isinstance(value, str)
                                   else tuple(value))
        if self.lora_target_modules is not None and (
                not self.lora_target_modules
                or not all(isinstance(t, str) for t in self.lora_target_modules)):
            raise ValueError("lora_target_modules must be module names (q_proj, ..., or all)")
        self.lora_paths()
        for name in ("max_loras_per_batch", "max_loaded_loras"):
            _positive_int(getattr(self, name), name)
        if self.max_lora_rank is not None:
            _positive_int(self.max_lora_rank, "max_lora_rank")
        if not isinstance(self.allow_runtime_lora_loading, bool):
            raise ValueError("allow_runtime_lora_loading must be a bool")
        if len(self.lora_paths()) > self.max_loaded_loras:
            raise ValueError(f"lora_modules: {len(self.lora_paths())} adapters; "
                             f"max_loaded_loras is {self.max_loaded_loras}")
        if not self.lora_enabled:
            return
        if self.speculative == "draft":
            raise ValueError("lora_modules / allow_runtime_lora_loading cannot be used with "
                             "speculative='draft': the draft model has no adapters")

    def _check_speculative_options(self) -> None:
        if self.speculative is not None:
            _one_of(self.speculative, SPECULATIVE_METHODS, "speculative")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("draft_model is needed for, and only for, speculative='draft'")
        _positive_int(self.num_speculative_tokens, "num_speculative_tokens")
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError("speculative_adaptive must be a bool")
        if self.num_speculative_tokens > 16:
            raise ValueError("num_speculative_tokens must be at most 16, "
                             f"got {self.num_speculative_tokens}")

    def _check_grammar_options(self) -> None:
        _one_of(self.grammar_backend, GRAMMAR_BACKENDS, "grammar_backend")
        for name in ("grammar_compile_workers", "grammar_cache_size"):
            _positive_int(getattr(self, name), name)
        for name, zero_ok in (("grammar_compile_timeout", False),
                              ("grammar_compile_max_memory_gb", True),
                              ("grammar_cache_memory_gb", True)):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or value < 0 or value == 0 and not zero_ok):
                raise ValueError(f"{name} must be a number {'>=' if zero_ok else '>'} 0, "
                                 f"got {value!r}")
        if isinstance(self.json_max_whitespace, bool) or not isinstance(
                self.json_max_whitespace, int) or not 0 <= self.json_max_whitespace <= 8:
            raise ValueError("json_max_whitespace must be an int in [0, 8], "
                             f"got {self.json_max_whitespace!r}")
        if self.enable_jump_forward is not None and not isinstance(self.enable_jump_forward,
                                                                   bool):
            raise ValueError("enable_jump_forward must be a bool or None")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; "
                             f"known options are {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            reason = ("this torch build has no CUDA" if torch.version.cuda is None
                      else "no CUDA device is visible")
            raise ValueError(f"device {self.device!r}: {reason}; use device 'cpu' (or 'auto')")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device, declared: str | None = None) -> torch.dtype:
        """The activation dtype. `declared`: the quantization the checkpoint declares (a
        GGUF model: gguf). Quantized weights run on the CPU with bfloat16 activations."""
        if self.dtype == "auto":
            quantized = (self.quantization != "none"
                         and (self.quantization is not None or declared is not None))
            packed = quantized and self.tp_size == 1
            return torch.bfloat16 if device.type == "cuda" or packed else torch.float32
        return DTYPES[self.dtype]


def _refuse_with(option: str, clashes: tuple[tuple[bool, str], ...]) -> None:
    """A ValueError naming `option` and the first setting it cannot be combined with."""
    for clash, why in clashes:
        if clash:
            raise ValueError(f"{option} cannot be used with {why}")


def _one_of(value: Any, choices: tuple[str, ...], name: str) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
