"""rhymerl without ray: ray stays a dependency that set-up installs, but only the Ray backend imports it, so every
command that does not choose that backend runs where ray is missing or broken (a GPU image without it, say).

One subprocess, with a `ray` package first on its path whose import raises, runs `generate`, a local `train`,
`report`, `bench engine`, `bench spec`, `bench matmul` and `bench pipe --no-real` through `cli.main` on a tiny
random model, then checks that nothing imported ray. A stand-in that merely hid ray would not catch an import
that is caught and ignored; this one also records every attempt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tiny_models import byte_model_dir

BROKEN_RAY = """
import os
open(os.environ["RAY_ATTEMPTS"], "a").write("imported\\n")
raise ImportError("ray is broken on this machine (tests/test_without_ray.py)")
"""

DRIVER = """
import json, sys
from rhymerl import cli
model, out = sys.argv[1], sys.argv[2]
run_dir = out + "/run"
commands = {
    "generate": ["generate", "--model", model, "--dtype", "fp32", "--device", "cpu", "--max-tokens", "4",
                 "--no-chat-template", "hi"],
    "train": ["train", f"model.name={model}", f"run.output_dir={out}/run",
              "data.num_train_prompts=4", "data.num_val_prompts=0", "data.max_prompt_length=240",
              "train.prompts_per_step=2", "train.total_steps=1", "rollout.num_generations=2",
              "rollout.max_completion_length=4", "val.max_completion_length=4", "val.every=0", "rollout.num_slots=4", "train.micro_batch_size=4",
              "train.dtype=fp32", "rollout.dtype=fp32", "run.progress=false", "run.tensorboard=false"],
    "bench engine": ["bench", "engine", "--model", model, "--dtype", "fp32", "--device", "cpu", "--batches", "2",
                     "--num-prompts", "2", "--max-tokens", "4", "--skip-hf"],
    "bench spec": ["bench", "spec", "--model", model, "--dtype", "fp32", "--device", "cpu", "--temperatures", "1.0",
                   "--num-prompts", "2", "--num-generations", "2", "--slots", "4", "--max-tokens", "4",
                   "--repeats", "1", "--identity-prompts", "1", "--identity-max-tokens", "4"],
    "bench matmul": ["bench", "matmul", "--model", model, "--rows", "2", "--repeats", "1"],
    "bench pipe": ["bench", "pipe", "--no-real", "--cost-from", sys.argv[3], "--workers", "2", "--slots", "4",
                   "--out", out + "/pipe"],
}
codes = {}
for name, argv in commands.items():
    codes[name] = cli.main(argv)
    if name == "train":
        codes["report"] = cli.main(["report", run_dir])
print("CODES " + json.dumps(codes))
print("RAY_LOADED " + json.dumps("ray" in sys.modules))
"""


def test_commands_run_where_ray_is_broken(tmp_path):
    model = byte_model_dir(tmp_path / "model", 256)
    fake = tmp_path / "fake"
    (fake / "ray").mkdir(parents=True)
    (fake / "ray" / "__init__.py").write_text(BROKEN_RAY)
    attempts = tmp_path / "ray-attempts.txt"
    cost = tmp_path / "cost.json"  # a flat cost model: bench pipe simulates without measuring an engine
    cost.write_text(json.dumps({"seqs": [1, 4], "tokens_per_seq": [1, 8], "seconds": [[0.01, 0.02], [0.02, 0.04]]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
           "RAY_ATTEMPTS": str(attempts), "RHYMERL_NATIVE": "0", "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVER), str(model), str(tmp_path / "out"),
                           str(cost)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines()
             if line.startswith(("CODES ", "RAY_LOADED "))}
    assert proc.returncode == 0 and "CODES" in lines, proc.stderr[-3000:]
    codes = json.loads(lines["CODES"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("rhymerl: error:")]
    if "AMX" in " ".join(errors):  # bench matmul times AMX tiles: elsewhere it ends with its own clear line
        assert codes.pop("bench matmul") == 2 and len(errors) == 1, errors
    assert codes == {name: 0 for name in codes} and len(codes) >= 6, (codes, errors)
    assert json.loads(lines["RAY_LOADED"]) is False
    assert not attempts.exists(), "something tried to import ray"
    assert Path(fake / "ray" / "__init__.py").exists()
