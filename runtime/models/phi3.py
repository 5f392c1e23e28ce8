"""Phi-3: the Llama decoder, loaded from a checkpoint that stores fused projections.

Phi-3 checkpoints hold `qkv_proj` ([q heads | k heads | v heads] rows) and `gate_up_proj`
([gate | up] rows) as single tensors. They are cut into their parts here and loaded part by
part like any Llama checkpoint, so tensor parallelism and quantized linears (which place each
part themselves) work unchanged. LongRoPE ("su" / "longrope" rope_scaling) lives in
layers/rotary.py.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from radixlm.runtime.models.llama import LlamaForCausalLM
from radixlm.runtime.models.weights.loading import narrow, tensor_shape


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            parts = self.fused_parts(name, tensor_shape(tensor)[0])
            if parts is None:
                yield name, tensor
                continue
            if not name.endswith((".weight", ".bias")):  # packed along other axes
                raise ValueError(f"{name}: fused projections of quantized Phi-3 checkpoints "
                                 f"are not supported")
            for part_name, start, rows in parts:
                # narrow reads only these rows of a lazy (per-rank) checkpoint slice
                yield part_name, narrow(tensor, 0, start, rows)

    def fused_parts(self, name: str, rows: int) -> list[tuple[str, int, int]] | None:
        """For a tensor of a fused projection (`rows` rows), the names of its parts' tensors
        with their first row and row count; None for any other tensor. Also how a LoRA
        adapter trained on the fused layer is cut into parts (models/lora/adapter.py)."""
        cfg = self.config
        if ".qkv_proj." in name:
            q_rows = cfg.num_heads * cfg.head_dim
            kv_rows = cfg.num_kv_heads * cfg.head_dim
            parts = {"q_proj": (0, q_rows), "k_proj": (q_rows, kv_rows),
                     "v_proj": (q_rows + kv_rows, kv_rows)}
            fused = ".qkv_proj."
        elif ".gate_up_proj." in name:
            parts = {"gate_proj": (0, rows // 2), "up_proj": (rows // 2, rows // 2)}
            fused = ".gate_up_proj."
        else:
            return None
        return [(name.replace(fused, f".{part}."), start, count)
                for part, (start, count) in parts.items()]
