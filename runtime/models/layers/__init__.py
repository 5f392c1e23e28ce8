"""Model layers written so that tensor parallelism and quantized linears can replace them."""
