"""Every Python block of README.md and docs/*.md runs as printed, or is marked as a fragment.

The blocks are extracted from the Markdown at test time, so a changed snippet is tested as
changed; docs/torch.md's DDP conversion (a ```` ```diff ````) runs as the converted script
it shows. A block is a fragment when the line before its fence is ``<!-- fragment -->`` (it
needs a communicator, a transport or data the page only describes). A block that says
``asynccoll run -n N`` runs under ``asynccoll run -n N``; any other runs under ``python``.
Each must exit 0 and write no traceback."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"


def blocks() -> list[tuple[str, str, bool]]:
    """``(id, code, fragment)`` of every ```` ```python ```` block, ids ``page#n``."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        n, i = 0, 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                n += 1
                prev = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
                j = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
                out.append((f"{page.relative_to(ROOT)}#{n}", "\n".join(lines[i + 1:j]) + "\n",
                            prev == FRAGMENT))
                i = j
            i += 1
    return out


def conversion() -> tuple[str, int]:
    """docs/torch.md's DDP conversion: the converted script rebuilt from its ```` ```diff ````
    block (context and added lines), and how many lines it changes."""
    text = (ROOT / "docs" / "torch.md").read_text()
    body = text.split("```diff\n", 1)[1].split("\n```", 1)[0].splitlines()
    after = [ln[1:] for ln in body if ln[:1] in (" ", "+")] + [""]
    return "\n".join(after), sum(ln[:1] in ("+", "-") for ln in body)


RUNNABLE = [(name, code) for name, code, fragment in blocks() if not fragment]
RUNNABLE.append(("docs/torch.md#conversion", conversion()[0]))


def test_ddp_conversion_changes_at_most_8_lines() -> None:
    code, changed = conversion()
    assert changed <= 8
    assert f"{changed} changed lines" in (ROOT / "docs" / "torch.md").read_text()
    assert "partial_hook" in code


def test_every_page_is_read_and_some_blocks_run() -> None:
    everything = blocks()
    assert len(everything) > 20
    assert {"README.md#1", "README.md#2", "docs/torch.md#1"} <= {n for n, _ in RUNNABLE}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "code"), RUNNABLE, ids=[n for n, _ in RUNNABLE])
def test_block_runs_as_printed(name: str, code: str, tmp_path: pathlib.Path) -> None:
    if "import torch" in code:
        pytest.importorskip("torch")
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASYNCCOLL_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    m = re.search(r"asynccoll run -n (\d+)", code)
    cmd = [sys.executable, str(script)] if m is None else \
        [sys.executable, "-m", "asynccoll.cli", "run", "-n", m.group(1), str(script)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=220)
    assert p.returncode == 0, f"{name} failed:\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr, f"{name}:\n{p.stderr}"
