"""The `radixlm` console script."""

from __future__ import annotations

import argparse
import io
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


def test_help_shows_every_default(capsys):
    for command in (["generate"], ["serve"], ["quantize"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        out = capsys.readouterr().out
        assert "(default: " in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "tokens to generate, at most (default: 128)" in out
    assert "the Engine and the server default to 1.0" in out  # --temperature says why 0 here
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--port PORT 0 picks a free port (the log says which) (default: 30000)" in out
    assert "--host HOST the address to listen on" in out


def test_a_misspelled_flag_is_named_with_the_closest_one_in_its_commands_usage(capsys):
    for argv, close, usage in ((["generate", "--max-new-tokns", "4", "hi"], "--max-new-tokens",
                                "usage: radixlm generate"),
                               (["serve", "--prot", "1"], "--port", "usage: radixlm serve")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and usage in err and f"did you mean {close}?" in err


def test_generate_without_a_prompt_says_so_before_loading_a_model(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    assert main(["generate", "--model", "/nonexistent/model"]) == 2
    assert "no prompt" in capsys.readouterr().err  # not the missing model: nothing loaded


def test_ctrl_c_is_a_line_and_exit_130_not_a_traceback(monkeypatch, capsys):
    import radixlm.runtime.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["generate"].set_defaults(func=interrupted)
    assert main(["generate", "hi"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


def test_several_prompts_are_labelled_by_their_index(tiny_chat_model, capsys):
    assert main(["generate", "a", "b", "c", "--model", str(tiny_chat_model),
                 "--max-new-tokens", "2", "--max-total-tokens", "1024"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line[:3] for line in lines if line.startswith("[")] == ["[0]", "[1]", "[2]"]
