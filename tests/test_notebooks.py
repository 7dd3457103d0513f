"""The notebooks run from top to bottom (nbclient, a "python3" kernel on this interpreter).

The kernel runs `sys.executable` (a kernelspec written to a temporary JUPYTER_PATH
entry, so no globally installed "python3" kernel can take over) with the repository
root as its working directory and on its PYTHONPATH. Nothing is written to the
repository: the executed notebooks stay in memory.
"""

import os
import pathlib
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ["01_tbe_quickstart.ipynb", "02_training.ipynb"]


@pytest.fixture
def python3_kernel(tmp_path, monkeypatch):
    """A "python3" kernelspec for this interpreter, found first on JUPYTER_PATH."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(path=str(tmp_path / "kernels" / "python3"))
    for var, first in (("JUPYTER_PATH", tmp_path), ("PYTHONPATH", ROOT)):
        rest = os.environ.get(var)
        monkeypatch.setenv(var, str(first) + (os.pathsep + rest if rest else ""))
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable, spec.argv
    return "python3"


def _untracked():
    """Files git does not know (and does not ignore), to check that a run leaves none."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "notebooks"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {line[3:] for line in out.splitlines() if line.startswith("??")}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, python3_kernel):
    path = ROOT / "notebooks" / name
    nb = nbformat.read(path, as_version=4)
    before = _untracked()
    client = nbclient.NotebookClient(nb, kernel_name=python3_kernel, timeout=600,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the notebook's plot was not drawn"
    assert _untracked() == before, "running the notebook left files behind"
