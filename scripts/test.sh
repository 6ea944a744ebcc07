#!/usr/bin/env bash
# Set up (cached), then run pytest; the real-model tests must run here, not skip.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
RHYMERL_REQUIRE_MODEL=1 exec .venv/bin/python -m pytest "$@"
