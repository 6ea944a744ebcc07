"""`import rhymerl` exposes the public API lazily; the torch-free modules stay torch-free."""

import subprocess
import sys

import rhymerl


def test_every_public_name_resolves():
    for name in rhymerl.__all__:
        assert getattr(rhymerl, name).__name__ == name


def test_torch_free_modules_do_not_import_torch():
    code = ("import sys, rhymerl, rhymerl.history, rhymerl.cost_model, rhymerl.histospec, rhymerl.config\n"
            "from rhymerl import HistoryStore, CostModel\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
