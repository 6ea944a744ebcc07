#!/usr/bin/env bash
# Set up (cached), then run rhymerl. Arguments, when given, replace the default command.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ $# -eq 0 ]; then
  set -- generate --model smollm2-135m "What is 12 * 7? Answer briefly."
fi
exec .venv/bin/rhymerl "$@"
