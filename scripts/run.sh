#!/usr/bin/env bash
# Set up (cached), then run rhymerl. Arguments, when given, replace the default command.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ $# -eq 0 ]; then
  set -- train  # the embedded default job: GRPO on smollm2-135m, built-in arithmetic task, sized to ~10 min on a 2-core CPU
fi
exec .venv/bin/rhymerl "$@"
