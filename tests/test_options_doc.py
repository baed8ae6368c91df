"""docs/options.md is what the options' definitions generate, and lists every `kvbank serve` flag."""

from pathlib import Path

from kvbank import options_doc
from kvbank.defaults import MAX_TOKENS_DEFAULTS

PAGE = Path(__file__).resolve().parent.parent / "docs" / "options.md"


def test_docs_options_md_is_what_the_generator_writes():
    assert PAGE.read_text() == options_doc.render(), (
        "docs/options.md differs from the options' definitions: regenerate it with "
        "`python -m kvbank.options_doc > docs/options.md`"
    )


def test_the_page_lists_every_serve_flag_and_request_default_and_no_environment_value(monkeypatch):
    monkeypatch.setenv("KVBANK_TIER_KEY", "a-tier-key-from-the-environment")
    page = options_doc.render()
    flags = [flag for action in options_doc._serve_parser()._actions for flag in action.option_strings]
    assert [flag for flag in flags if f"`{flag}`" not in page] == ["-h", "--help"]
    assert "| `--kv-tier-key` | `KEY` | $KVBANK_TIER_KEY, else no key | `$KVBANK_TIER_KEY` |" in page
    assert "a-tier-key-from-the-environment" not in page
    for default in MAX_TOKENS_DEFAULTS:
        assert f"| {default.surface} | {default.value} |" in page
