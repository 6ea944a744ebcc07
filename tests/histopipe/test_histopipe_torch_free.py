"""HistoPipe's core is torch-free: planning and simulation run anywhere, before any model loads."""

import subprocess
import sys


def test_histopipe_does_not_import_torch():
    code = ("import sys, rhymerl.histopipe\n"
            "from rhymerl.histopipe import (batching, censored, fleet, metrics, pieces, plan, predict, rebalance, simulate,\n"
            "                               timeline, workload)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
