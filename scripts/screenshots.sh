#!/usr/bin/env bash
# Regenerates the console screenshots in docs/ (queue, detail, approve dialog, activity,
# insights) by running the browser tests with LEADGATE_SCREENSHOTS=docs.
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.."
LEADGATE_SCREENSHOTS=docs .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/acceptance/test_console_browser.py
ls -l docs/console-*.png
