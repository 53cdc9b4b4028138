#!/usr/bin/env bash
# Runs `rlc validate` on this repo; usable from any CI. Needs `rlc` on PATH, or RLC_BIN.
set -euo pipefail
cd "$(dirname "$0")/.."
RLC_BIN="${RLC_BIN:-rlc}"
if ! command -v "$RLC_BIN" >/dev/null 2>&1; then
  echo "ci/validate.sh: '$RLC_BIN' not found; install rlc (cargo install --git <this project's repo> rlc) or set RLC_BIN" >&2
  exit 2
fi
exec "$RLC_BIN" validate .
