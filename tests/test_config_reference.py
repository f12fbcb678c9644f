"""docs/config.md is the generated configuration reference: it must match the config tree."""

from molt_hpc.config import MoltConfig
from molt_hpc.config.reference import reference_markdown, section_class
from tests.conftest import ROOT, molt


def test_docs_config_md_is_the_current_reference():
    want = reference_markdown(MoltConfig)
    have = (ROOT / "docs" / "config.md").read_text()
    assert have == want, "docs/config.md is stale: molt-hpc config --docs --format markdown > docs/config.md"


def test_reference_lists_every_field_of_every_section_with_its_docstring():
    text = reference_markdown(MoltConfig)

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            sub = section_class(field.annotation)
            if sub is not None:
                assert f"## `[{'.'.join([*prefix, name])}]`" in text
                walk(sub, [*prefix, name])
            else:
                assert field.description, f"{'.'.join([*prefix, name])} has no docstring"
                assert f"| `{name}` |" in text

    walk(MoltConfig, [])


def test_cli_prints_the_reference_and_refuses_it_without_docs():
    done = molt("config", "--docs", "--format", "markdown")
    assert done.returncode == 0 and done.stdout == reference_markdown(MoltConfig)
    bad = molt("config", "--format", "markdown")
    assert bad.returncode == 2 and "--docs" in bad.stderr
