"""The README's first example runs as written (it checks map against eager itself)."""

import pathlib
import re
import sys
import types

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(capsys, monkeypatch):
    text = README.read_text()
    source = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "encode.map(" in source and "assert_close" in source
    module = types.ModuleType("readme_example")  # (dataclasses look their module up)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source, str(README), "exec"), module.__dict__)
    assert "Stats(instances=32" in capsys.readouterr().out
