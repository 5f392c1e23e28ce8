"""Checkpoint tensors -> parameters: the one place that reads, narrows and shape-checks a
checkpoint's tensors, for the plain layers and the quantized linear methods alike."""
