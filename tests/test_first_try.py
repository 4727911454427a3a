"""The command line as a person first tries it: `serve` beside the other subcommands, app.py's --model and refusals,
help on every flag, a subcommand's own usage, aliases of chip generations, sizes checked by plan as by generate, and
a pipe closed early."""
import argparse
import os
import subprocess
import sys

import pytest

from acceldemo.cli import build_parser, main
from acceldemo.cli.plan import known_generations, resolve_generation
from acceldemo.cli.serve import add_arguments, serve_settings
from acceldemo.config import Settings
from acceldemo.errors import InvalidRequest
from acceldemo.hardware import hardware_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("info", "generate", "warmup", "cache", "compare", "plan", "bench", "serve")


def run(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=timeout, stdin=subprocess.DEVNULL)


def in_process(capsys, *args) -> tuple[int, str, str]:
    try:
        status = main(list(args))
    except SystemExit as exit:
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


# 1. serve is app.py's command line
def test_serve_takes_app_py_s_flags():
    done = run("-m", "acceldemo", "serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: python -m acceldemo serve" in done.stdout
    for flag in ("--port", "--warmup", "--model", "--host", "--auth", "--ray", "--artifacts", "--replicas"):
        assert flag in done.stdout, flag
    app = run("app.py", "--help")
    assert app.returncode == 0 and "usage: app.py" in app.stdout
    served = {a.dest for a in subcommands(build_parser())["serve"]._actions}
    alone = argparse.ArgumentParser()
    add_arguments(alone)
    assert {a.dest for a in alone._actions} == served


# 2. --model sets the default model, checked against the catalog
def _serve_args(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_app_model_flag_sets_the_default_model():
    settings = Settings.from_env({})
    assert serve_settings(_serve_args(), settings).default_model == settings.default_model
    chosen = serve_settings(_serve_args("--model", "tiny-sd3", "--port", "9000"), settings)
    assert (chosen.default_model, chosen.port) == ("tiny-sd3", 9000)
    with pytest.raises(InvalidRequest, match="model='nope' is not accepted: known values are .*tiny-sd3"):
        serve_settings(_serve_args("--model", "nope"), settings)


def test_app_with_an_unknown_model_is_one_error_line_and_exit_2():
    done = run("app.py", "--model", "nope")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: model='nope' is not accepted: known values are ") and "tiny-shapes" in line


# 3. a bad variable at start-up is one line, as the CLI says it
@pytest.mark.parametrize("command", [["app.py"], ["-m", "acceldemo", "serve"]])
def test_a_bad_variable_at_serve_start_is_one_error_line(command):
    done = run(*command, env={"ACCELDEMO_QUEUE_SIZE": "abc"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["error: ACCELDEMO_QUEUE_SIZE='abc' is not accepted: a whole number"]


# 4. a reader that goes away early
def test_a_closed_pipe_ends_quietly():
    reader, writer = os.pipe()
    os.close(reader)  # nobody will read: the first write fails with EPIPE
    try:
        process = subprocess.Popen([sys.executable, "-m", "acceldemo", "plan", "--host", "h100"], cwd=ROOT,
                                   stdout=writer, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    finally:
        os.close(writer)
    _, err = process.communicate(timeout=300)
    assert process.returncode in (0, 1) and "Traceback" not in err and "Exception ignored" not in err, err


def test_a_pipe_closed_after_one_line_ends_quietly():
    process = subprocess.Popen([sys.executable, "-m", "acceldemo", "plan", "--host", "h100"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    first = process.stdout.readline()
    process.stdout.close()
    process.wait(timeout=300)
    err = process.stderr.read()
    process.stderr.close()
    assert " on h100 " in first and "Traceback" not in err and "Exception ignored" not in err, err


# 5. plan checks the size as generate does
def test_plan_refuses_a_size_generate_refuses_with_the_same_words(capsys):
    asked = ["--model", "tiny-flux2-klein", "--size", "100x64"]
    status, out, err = in_process(capsys, "plan", "--host", "h100", *asked)
    assert status == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line == "error: width=100 is not accepted: tiny-flux2-klein needs a multiple of 16 from 64 to 512 — try 96"
    status, _, generate_err = in_process(capsys, "generate", "--prompt", "x", *asked)
    assert status == 2 and generate_err.strip() == line
    status, _, err = in_process(capsys, "plan", "--host", "h100", "--model", "flux2-klein-4b", "--size", "1000x1000")
    assert status == 2 and "width=1000 is not accepted: flux2-klein-4b needs a multiple of 16" in err
    status, out, _ = in_process(capsys, "plan", "--host", "h100", "--model", "flux2-klein-4b", "--size", "1024x1024")
    assert status == 0 and "flux2-klein-4b on h100" in out


# 6. chip generations by any usual spelling; an unknown one refused with the known ones
@pytest.mark.parametrize("typed", ["v6e", "V6E", "tpu-v6e", "TPU v6e", "tpu v6e", "tpu_v6e", "TPUv6e"])
def test_generation_aliases(typed):
    assert resolve_generation("tpu", typed) == "TPU v6e"


def test_every_known_generation_resolves_from_its_short_lower_case_name():
    for hardware in hardware_names():
        for name in known_generations(hardware):
            assert resolve_generation(hardware, name) == name
            assert resolve_generation(hardware, name.lower().removeprefix(hardware).strip()) == name
    assert {"TPU v5e", "TPU v6e", "TPU v5p"} <= set(known_generations("tpu"))
    assert "sm_90" in known_generations("cuda") and "Trainium2" in known_generations("neuron")
    assert resolve_generation("cuda", "SM90") == "sm_90" and resolve_generation("tpu", "") == ""


def test_an_unknown_generation_is_refused_with_the_known_ones(capsys):
    status, out, err = in_process(capsys, "plan", "--hardware", "tpu", "--devices", "4", "--device-memory", "32GB",
                                  "--generation", "v9z")
    assert status == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("error: generation='v9z' is not accepted: one of ") and "TPU v6e" in line
    status, _, err = in_process(capsys, "plan", "--hardware", "cpu", "--devices", "1", "--device-memory", "32GB",
                                "--generation", "v6e")
    assert status == 2 and "cpu has none" in err


def test_an_alias_plans_as_the_full_name(capsys):
    plans = []
    for typed in ("v6e", "TPU v6e"):
        status, out, _ = in_process(capsys, "plan", "--hardware", "tpu", "--devices", "4", "--device-memory", "32GB",
                                    "--generation", typed, "--model", "flux2-klein-4b", "--json")
        assert status == 0
        plans.append(out)
    assert plans[0] == plans[1] and "TPU v6e" in plans[0]


# 7. help for every command and every flag, with its default
def test_top_level_help_names_every_command():
    parser = build_parser()
    assert set(subcommands(parser)) == set(COMMANDS)
    text = parser.format_help()
    for name in COMMANDS:
        assert f"\n    {name} " in text, name
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert all(choice.help for choice in action._choices_actions)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_that_says_its_default(command):
    parser = subcommands(build_parser())[command]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings:
            continue
        assert action.help and action.help is not argparse.SUPPRESS, (command, action.option_strings)
        shown = formatter._expand_help(action)
        # A value flag says its default (an on/off switch is off unless given; a required flag has none).
        if action.nargs != 0 and not action.required:
            assert "default" in shown, (command, action.option_strings, shown)


# 8. an unknown flag gets the subcommand's usage
@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["plan"], ["serve"], ["info"]])
def test_an_unknown_flag_shows_the_subcommand_usage(capsys, command):
    status, out, err = in_process(capsys, *command, "--nope")
    assert status == 2 and out == ""
    assert f"usage: python -m acceldemo {command[0]}" in err and "unrecognized arguments: --nope" in err


def test_an_unknown_flag_in_a_real_process():
    done = run("-m", "acceldemo", "generate", "--nope")
    assert done.returncode == 2 and "usage: python -m acceldemo generate" in done.stderr
