"""docs/PARAMS.md is generated from the params schema's descriptions (workflow/sync_params_doc.py, issue 35 item 6):
every key has a description, and the committed document is what the generator writes from the schema."""
from __future__ import annotations

import shutil
import sys

import yaml

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "workflow"))
import sync_params_doc  # noqa: E402


def test_docs_params_md_is_generated_from_the_schema_and_every_key_has_a_description(capsys):
    assert sync_params_doc.main(["--check"]) == 0, capsys.readouterr().err
    schema = yaml.safe_load(sync_params_doc.SCHEMA.read_text())
    params = yaml.safe_load(sync_params_doc.PARAMS.read_text())
    keys = [e["key"] for e in sync_params_doc.entries(schema, params)]
    doc = sync_params_doc.DOC.read_text()
    for top, section in params.items():            # every params.yaml key has its row (a top-level its section)
        assert f"## `{top}`" in doc
        for key in (section if isinstance(section, dict) else {}):
            assert f"{top}.{key}" in keys and f"| `{top}.{key}` |" in doc, key


def test_a_key_without_a_description_or_a_stale_document_fails_the_check_naming_it(tmp_path, monkeypatch, capsys):
    schema_copy, doc_copy = tmp_path / "params.schema.yaml", tmp_path / "PARAMS.md"
    shutil.copy2(sync_params_doc.SCHEMA, schema_copy)
    shutil.copy2(sync_params_doc.DOC, doc_copy)
    monkeypatch.setattr(sync_params_doc, "SCHEMA", schema_copy)
    monkeypatch.setattr(sync_params_doc, "DOC", doc_copy)
    monkeypatch.setattr(sync_params_doc, "ROOT", tmp_path)
    assert sync_params_doc.main(["--check"]) == 0
    schema = yaml.safe_load(schema_copy.read_text())
    del schema["properties"]["train"]["properties"]["lr"]["description"]
    schema_copy.write_text(yaml.safe_dump(schema, sort_keys=False))
    assert sync_params_doc.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "train.lr has no description" in err and "PARAMS.md is stale" in err
    assert sync_params_doc.main([]) == 1 and "train.lr" in capsys.readouterr().err    # nothing written without it


def test_the_schema_reads_the_same_with_libyaml_as_with_pure_python():
    """load_schema parses with libyaml where PyYAML has it (every process reads the schema): the same dict as
    PyYAML's pure-Python SafeLoader gives, so no key, default or enum depends on which parser a machine has."""
    from stages.lib.params import SCHEMA_PATH, load_schema
    assert load_schema() == yaml.safe_load(SCHEMA_PATH.read_text(encoding="utf-8"))
