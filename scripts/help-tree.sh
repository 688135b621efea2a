#!/usr/bin/env bash
# Prints `farmap --help` and the --help of every subcommand, recursively, to stdout: the
# command-line surface other tools read (flags, defaults, help text), to compare two builds.
#   scripts/help-tree.sh [FARMAP_BINARY]   (default: target/debug/farmap)
set -euo pipefail
bin="${1:-target/debug/farmap}"
walk() {
  echo "=== farmap $* --help"
  "$bin" "$@" --help
  # Subcommands are listed under "Commands:" as two-space-indented names (hidden ones are not).
  "$bin" "$@" --help | awk '/^Commands:/{c=1;next} c&&/^$/{c=0} c&&/^  [a-z]/{print $1}' |
    while read -r sub; do
      [[ $sub == help ]] && continue
      walk "$@" "$sub"
    done
}
walk
