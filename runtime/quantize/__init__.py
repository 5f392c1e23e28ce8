"""`radixlm quantize`: our quantizers (round-to-nearest, AWQ, GPTQ), calibration runs over a
loaded model, and checkpoints written in the AWQ and GPTQ formats that
`radixlm.runtime.models.quantization` (and other readers) load. It sits above the models: it
loads one, runs it layer by layer and writes its weights out.
"""
