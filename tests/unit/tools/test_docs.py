"""The docs cannot drift from the code: the reference pages are what the code generates, and
every flag, settings key and ROLLOUT_* variable the README and docs/ name exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import docs_drift, gen_docs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(gen_docs.PAGES))
def test_each_reference_page_is_what_the_code_generates(name: str) -> None:
    committed = (gen_docs.REFERENCE / name).read_text()
    assert committed == gen_docs.PAGES[name](), f"docs/reference/{name} is out of date: run `make docs`"


@pytest.mark.timeout(120)
def test_every_name_the_docs_give_exists_in_the_code() -> None:
    assert [str(problem) for problem in docs_drift.check_all()] == []


@pytest.mark.timeout(120)
def test_a_wrong_flag_setting_or_variable_is_found() -> None:
    page = "\n".join(
        [
            "Train with `--max_staleness 2`, or set `scheduler.max_inflight` (`ROLLOUT_SCHEDULER__MAX_INFLIGHT`).",
            "```bash",
            "rollout-trainer --num_generations 8 \\",
            "    --max_stalenes 2",
            "rollout-service serve --vllm-url http://h:8000 --vllm-arg --enable-lora --kv-cache 4",
            "```",
            "Then `--learning-rat`, `scheduler.max_inflite` and ROLLOUT_SCHEDULER__MAX_INFLITE.",
        ]
    )
    found = [(problem.line, problem.what) for problem in docs_drift.check_text(page, "planted.md")]
    assert found == [
        (3, "rollout-trainer has no option --max_stalenes"),
        (5, "rollout-service has no option --kv-cache"),
        (7, "ROLLOUT_SCHEDULER__MAX_INFLITE is no setting's variable, and the code reads no such name"),
        (7, "--learning-rat is an option of no command line here (nor a known vLLM flag)"),
        (7, "scheduler.max_inflite is not a setting of the service"),
    ]


@pytest.mark.timeout(120)
def test_marks_read_the_block_below_them_and_a_stray_mark_is_reported() -> None:
    page = "\n".join(["<!-- file: tasks.jsonl -->", "```json", "{}", "```", "<!-- runnable -->", "", "```bash", "x"])
    blocks, problems = docs_drift.marked_blocks(page + "\n```\n<!-- runable -->\n```bash\n```", Path("planted.md"))
    found = [(block.line, block.mark, block.language, block.text) for block in blocks]
    assert found == [(2, "file: tasks.jsonl", "json", "{}\n")]
    assert [problem.line for problem in problems] == [5, 10]  # a blank line between; a misspelt mark


@pytest.mark.timeout(120)
def test_the_getting_started_pages_and_the_readme_have_runnable_blocks() -> None:
    runnable = {
        str(page.relative_to(docs_drift.ROOT))
        for page in docs_drift.documentation()
        for block in docs_drift.marked_blocks(page.read_text(), page)[0]
        if block.mark.startswith("runnable")
    }
    getting_started = {"docs/getting-started/quickstart.md", "docs/getting-started/your-task.md"}
    assert {"README.md", "docs/api/index.md", *getting_started} <= runnable


@pytest.mark.timeout(120)
def test_a_named_entry_of_a_mapping_setting_has_variables_of_its_settings() -> None:
    page = "ROLLOUT_JUDGES__G__MAX_SCORE=4, ROLLOUT_SECURITY__PRINCIPALS__AL__TOKEN, not ROLLOUT_JUDGES__G__MAX"
    found = [problem.what for problem in docs_drift.check_text(page, "planted.md")]
    assert found == ["ROLLOUT_JUDGES__G__MAX is no setting's variable, and the code reads no such name"]
