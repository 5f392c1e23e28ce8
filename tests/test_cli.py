"""The `radixlm` console script."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from radixlm.runtime.cli import main


def test_models_lists_the_default(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "Qwen3ForCausalLM" in out


def test_generate_with_a_tiny_model(tiny_chat_model, capsys):
    code = main(["generate", "Hello", "--model", str(tiny_chat_model), "--max-new-tokens", "4",
                 "--max-total-tokens", "1024"])
    assert code == 0 and capsys.readouterr().out.strip()


def test_bad_input_is_an_error_message_not_a_traceback(tiny_chat_model, capsys):
    code = main(["generate", "Hello", "--model", str(tiny_chat_model), "--top-p", "0",
                 "--max-total-tokens", "1024"])
    assert code == 2 and "top_p" in capsys.readouterr().err


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "radixlm.runtime.cli", "models"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "supported architectures" in result.stdout


def test_chat_stream_prints_what_generate_prints(tiny_chat_model, capsys):
    args = ["generate", "Hello", "--chat", "--model", str(tiny_chat_model),
            "--max-new-tokens", "8", "--max-total-tokens", "1024"]
    assert main(args) == 0
    whole = capsys.readouterr().out
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == whole


def test_version_and_the_spellings_vllm_and_sglang_users_type(tiny_chat_model, tmp_path,
                                                              capsys):
    from radixlm.runtime.config.engine_config import EngineConfig
    from radixlm.runtime.server.args import add_serve_args, engine_options

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("radixlm ")

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args([str(tiny_chat_model), "-tp", "1", "--context-length", "512",
                              "--mem-fraction-static", "0.3", "--dtype", "fp32",
                              "--log-level", "WARNING"])
    options = engine_options(args)
    assert options["model"] == str(tiny_chat_model) and options["max_model_len"] == 512
    assert options["kv_cache_memory_fraction"] == 0.3 and args.log_level == "warning"
    assert EngineConfig.from_kwargs(**options).dtype == "float32"
    both = parser.parse_args([str(tiny_chat_model), "--model-path", "other"])
    with pytest.raises(ValueError, match="given twice"):
        engine_options(both)
    with pytest.raises(SystemExit):  # argparse lists the valid backends
        parser.parse_args(["--attention-backend", "magic"])

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    code = main(["generate", "Hi", "--chat", "--chat-template", str(template),
                 "--model-path", str(tiny_chat_model), "--max-new-tokens", "2",
                 "--max-total-tokens", "1024", "--dtype", "bf16", "--speculative", "ngram"])
    assert code == 0
    from radixlm.runtime import Engine

    with Engine(str(tiny_chat_model), chat_template=str(template), max_total_tokens=1024) as eng:
        assert eng.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<<Hi>>"
    with pytest.raises(FileNotFoundError, match="chat_template"):
        Engine(str(tiny_chat_model), chat_template="no/such/file.jinja")


def test_loader_failures_are_one_clear_line(tiny_chat_model, tmp_path, capsys):
    import shutil

    import torch

    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_chat_model, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    cases = [(["--model", "./no-such-model"], "'./no-such-model' not found"),
             (["--model", str(corrupt)], "model.safetensors is not a readable safetensors")]
    if not torch.cuda.is_available():
        cases.append((["--model", str(tiny_chat_model), "--device", "cuda"], "device 'cuda'"))
    for extra, message in cases:
        assert main(["generate", "hi", "--max-total-tokens", "1024", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
