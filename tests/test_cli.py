"""The `radixlm` console script."""

from __future__ import annotations

import subprocess
import sys

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
