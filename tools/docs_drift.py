"""Names in the docs that must exist in the code: the flags of ``rollout-service``,
``rollout-trainer`` and ``rollout-env`` in command lines and in inline code, the service's settings keys, and the
``ROLLOUT_*`` environment variables. ``python tools/docs_drift.py`` lists what is wrong.

It also reads the blocks the docs mark for the suite to run (``marked_blocks``)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("engine", "scheduler", "weight_sync", "adapters", "security")
ARCHIVE = ROOT / "docs" / "benchmarks" / "speed-history.md"
"""A lab notebook of past sittings: the flags it names were right when it was written."""
OTHER_TOOLS_FLAGS = frozenset(
    {
        # vLLM's own server flags, named where a user starts vLLM or passes them through --vllm-arg.
        "--enable-lora",
        "--max-loras",
        "--max-lora-rank",
        "--served-model-name",
        "--weight-transfer-config",
        "--enable-prefix-caching",
        "--block-size",
        "--dtype",
        "--max-model-len",
        "--gpu-memory-utilization",
        "--tensor-parallel-size",
        "--data-parallel-size",
        "--enable-scale-out",
        "--port",
        "--host",
        "--worker-extension-cls",
        "--logprobs-mode",
        "--disable-log-stats",
        # pip, pytest, accelerate/torchrun, mkdocs, podman, npm and git.
        "--sysctl",
        "--index-url",
        "--extra-index-url",
        "--strict",
        "--nproc_per_node",
        "--num_processes",
        "--timeout",
        "--build",
        "--force",
    }
)
COMMAND_LINES = ("rollout-service", "rollout-trainer", "rollout-env")
FLAG = re.compile(r"(?<![\w-])--[a-zA-Z][\w-]*")
SETTING = re.compile(rf"^(?:{'|'.join(SECTIONS)})(?:\.[a-z_]+)+$(?<!\.py)")
ENV = re.compile(r"\bROLLOUT_[A-Z0-9_]*[A-Z0-9]\b")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
MARK = re.compile(r"^<!-- (runnable|runnable: service|file: [\w.-]+) -->$")
MARK_LIKE = re.compile(r"^<!--\s*(run|file)")


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


@cache
def typer_flags(tool: str) -> frozenset[str]:
    """The flags of ``rollout-service`` or ``rollout-env``, from their typer apps."""
    import typer.main

    from rollout_env.cli import app as env_app
    from rollout_service.edge.cli import app as service_app

    group = typer.main.get_command({"rollout-service": service_app, "rollout-env": env_app}[tool])
    flags = {"--help"}
    for command in group.commands.values():  # type: ignore[attr-defined]
        for param in command.params:
            flags.update(getattr(param, "opts", []), getattr(param, "secondary_opts", []))
    return frozenset(flag for flag in flags if flag.startswith("--"))


@cache
def trainer_flags() -> frozenset[str]:
    from trainer_client.cli import IGNORED_TRL_SETTINGS, TrainerArgumentParser

    flags = {flag for action in TrainerArgumentParser()._actions for flag in action.option_strings}
    flags |= {f"--{name}" for name in IGNORED_TRL_SETTINGS}  # accepted, with a warning
    return frozenset(flag for flag in flags if flag.startswith("--"))


@cache
def script_flags() -> dict[str, frozenset[str]]:
    """Each benchmark's and tool's flags, by file name, from its ``add_argument`` calls."""
    declared = re.compile(r"add_argument\(\s*\"(--[\w-]+)\"(?:,\s*\"(--[\w-]+)\")?")
    flags = {}
    for script in [*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "tools").glob("*.py")]:
        found = {flag for pair in declared.findall(script.read_text()) for flag in pair if flag}
        flags[script.name] = frozenset(found | {"--help"})
    return flags


@cache
def setting_paths() -> frozenset[str]:
    """Every settings key, sections included, as the reference page lists them."""
    from rollout_service.config import ServiceSettings
    from tools.gen_docs import settings_sections

    return frozenset(
        f"{path}.{name}" if path else name
        for path, model in settings_sections(ServiceSettings)
        for name in model.model_fields
    )


@cache
def environment_names() -> frozenset[str]:
    """The settings' variables, and every ROLLOUT_* name the code itself reads."""
    names = {f"ROLLOUT_{path.upper().replace('.', '__')}" for path in setting_paths()}
    sources = [ROOT / "tests" / "integration" / "conftest.py", *(ROOT / "examples").rglob("*.mjs")]
    sources += (ROOT / "examples").rglob("*.go")
    for package in ("rollout_service", "trainer_client", "rollout_api", "rollout_common", "rollout_demo"):
        sources += (ROOT / package).rglob("*.py")
    for source in sources:
        names.update(ENV.findall(source.read_text()))
    return frozenset(names)


@cache
def mapped_variable() -> re.Pattern[str]:
    """The variables of settings that map names to a section: ``ROLLOUT_JUDGES__<NAME>__URL``."""
    from rollout_service.config import ServiceSettings
    from tools.gen_docs import mapping_sections

    forms = [
        f"ROLLOUT_{path.upper().replace('.', '__')}__[A-Z0-9_]+?__({'|'.join(map(str.upper, section.model_fields))})"
        for path, _, section in mapping_sections(ServiceSettings)
    ]
    return re.compile("|".join(forms))


@dataclass(frozen=True)
class MarkedBlock:
    """A fenced block under a mark: ``runnable`` (the suite runs it), ``runnable: service`` (the
    same, against a service it starts at the block's 127.0.0.1:50051), or ``file: NAME`` (the
    runnable blocks of the page find it in their folder under that name)."""

    path: Path
    line: int
    mark: str
    language: str
    text: str


def marked_blocks(text: str, path: Path) -> tuple[list[MarkedBlock], list[Problem]]:
    """The page's marked blocks, and the marks not right above a fenced block."""
    blocks: list[MarkedBlock] = []
    problems: list[Problem] = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not MARK_LIKE.match(line):
            continue
        mark = MARK.match(line)
        fence = lines[number] if number < len(lines) else ""
        if mark is None or not fence.startswith("```") or len(fence) == 3:
            why = "a mark is <!-- runnable -->, <!-- runnable: service --> or <!-- file: NAME -->, above ```LANGUAGE"
            problems.append(Problem(str(path), number, why))
            continue
        end = lines.index("```", number + 1)
        body = "\n".join(lines[number + 1 : end]) + "\n"
        blocks.append(MarkedBlock(path, number + 1, mark.group(1), fence[3:].strip(), body))
    return blocks, problems


def command_lines(lines: list[str]) -> Iterable[tuple[int, str]]:
    """The lines of fenced blocks, backslash continuations joined, with their first line's number."""
    inside, start, pending = False, 0, ""
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def check_text(text: str, path: str) -> list[Problem]:
    problems = marked_blocks(text, Path(path))[1]
    lines = text.splitlines()
    for number, command in command_lines(lines):
        problems += _check_command(command, path, number)
    inside = False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            inside = not inside
        for name in ENV.findall(line):
            if name not in environment_names() and not mapped_variable().fullmatch(name):
                why = f"{name} is no setting's variable, and the code reads no such name"
                problems.append(Problem(path, number, why))
        if inside:
            continue
        for span in INLINE.findall(line):
            problems += _check_span(span.strip(), path, number)
    return problems


def _check_command(command: str, path: str, number: int) -> list[Problem]:
    problems = []
    for segment in re.split(r"\s(?:\|\||&&|\||;)\s", command):
        words = segment.split()
        tool = next((w for w in words if w in COMMAND_LINES or _script(w)), None)
        if tool is None:
            continue
        if _script(tool):
            known = script_flags()[_script(tool)]
        else:
            known = trainer_flags() if tool == "rollout-trainer" else typer_flags(tool)
        after_pass_through = False
        for word in words[words.index(tool) + 1 :]:
            if after_pass_through:  # --vllm-arg's value is vLLM's own flag
                after_pass_through = False
                continue
            flag = word.split("=", 1)[0]
            if not FLAG.fullmatch(flag):
                continue
            after_pass_through = flag == "--vllm-arg" and "=" not in word
            if flag not in known:
                problems.append(Problem(path, number, f"{tool} has no option {flag}"))
    return problems


def _script(word: str) -> str:
    """The benchmark or tool a word names (``benchmarks/bench_x.py``), else ""."""
    name = Path(word).name
    return name if word.endswith(".py") and name in script_flags() else ""


def _check_span(span: str, path: str, number: int) -> list[Problem]:
    words = span.split()
    if _script(words[0]) and len(words) > 1:
        return _check_command(span, path, number)
    flag = span.split("=", 1)[0].split(" ", 1)[0]
    if FLAG.fullmatch(flag):
        tools = typer_flags("rollout-service") | typer_flags("rollout-env") | trainer_flags()
        known = tools | OTHER_TOOLS_FLAGS | frozenset().union(*script_flags().values())
        if flag not in known:
            return [Problem(path, number, f"{flag} is an option of no command line here (nor a known vLLM flag)")]
    elif SETTING.match(span) and span not in setting_paths():
        return [Problem(path, number, f"{span} is not a setting of the service")]
    return []


def documentation() -> list[Path]:
    return [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").rglob("*.md")) if p != ARCHIVE)]


def check_all() -> list[Problem]:
    problems = []
    for page in documentation():
        problems += check_text(page.read_text(), str(page.relative_to(ROOT)))
    return problems


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script: ``tools`` importable as a package
    found = check_all()
    print("\n".join(map(str, found)) or "every name in the docs exists")
    sys.exit(1 if found else 0)
