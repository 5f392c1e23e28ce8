"""The README's quantize-then-generate steps, on the embedded default model as written there
(a GGUF file: its blocks are dequantized to float weights, then quantized again)."""

from __future__ import annotations

import json

import pytest

from radixlm.runtime.cli import main


@pytest.mark.slow
def test_quantize_the_default_model_then_generate_with_it(tmp_path, capsys):
    out = tmp_path / "smollm2-rtn"
    # The README's command with rtn, which shares every step with awq and gptq but the search
    # (those take minutes on 2 cores; test_quant_quantizers checks the searches themselves).
    assert main(["quantize", "--method", "rtn", "--out", str(out)]) == 0
    assert "comes from a GGUF file" in capsys.readouterr().err
    declared = json.loads((out / "config.json").read_text())["quantization_config"]
    assert declared["quant_method"] == "gptq" and declared["bits"] == 4
    assert main(["generate", "--model", str(out), "--max-new-tokens", "8", "Hello"]) == 0
    assert capsys.readouterr().out.strip()


def test_an_already_quantized_checkpoint_is_refused_by_name(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "gptq"}}))
    assert main(["quantize", "--model", str(folder), "--method", "rtn",
                 "--out", str(tmp_path / "out")]) == 2
    assert "already quantized (gptq)" in capsys.readouterr().err
