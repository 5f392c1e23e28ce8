"""Other frontends' exact names over radixlm's language: `radixlm.compat.sglang`."""
