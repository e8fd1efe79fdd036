"""`import eightbit` from the checkout's root: the root's source folders (kernels/, engine/, ...) are eightbit's parts,
never top-level packages that shadow installed ones, with an editable install or a plain one."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_in_root(code) -> list[str]:
    """The lines `code` prints, run by `python -c` in the checkout's root."""
    env = dict(os.environ)
    env.pop("PYTHONSAFEPATH", None)  # as a user's shell has it: `python -c` puts the working directory on sys.path
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_root_kernels_folder_does_not_shadow_the_installed_kernels_package():
    # transformers (5.25 on) imports the package named `kernels` wherever it finds one: in the root, ours came first
    # and `from transformers import LlamaForCausalLM` failed with an ImportError
    top_level_kernels, ours = run_in_root("import sys, eightbit\n"
                                          "from transformers import LlamaForCausalLM\n"
                                          "import eightbit.kernels\n"
                                          "print(getattr(sys.modules.get('kernels'), '__file__', None))\n"
                                          "print(eightbit.kernels.__file__)")[-2:]
    assert Path(ours) == ROOT / "kernels" / "__init__.py"
    assert not top_level_kernels.startswith(str(ROOT)), top_level_kernels


def test_import_in_root_without_the_editable_finder():
    # after a plain `pip install .`, Python started in the root imports eightbit from the root's eightbit/ folder,
    # which holds only the front door: its parts are found in the root's folders all the same
    printed = run_in_root("import sys\n"
                          "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in f.__module__]\n"
                          "from eightbit import LLM, SamplingParams\n"
                          "import eightbit.engine.models.llama, eightbit.kernels.int8_gemm, eightbit.quant\n"
                          "print(eightbit.engine.models.llama.__file__)")
    assert Path(printed[-1]) == ROOT / "engine" / "models" / "llama.py"
