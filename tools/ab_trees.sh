#!/usr/bin/env bash
# A/B of this tree against an earlier revision on one machine (the GPU machine has no git history):
#
#   here:   tools/ab_trees.sh pack REV      the files of jitattn/ and templates/ that differ between REV
#                                           and the working tree, as of REV, into .ab/ (git-ignored: name
#                                           it in the device run's carry list)
#   there:  tools/ab_trees.sh run CMD...    CMD on this tree ("== A"), then on the tree with .ab's files in
#                                           place ("== B", REV), then this tree back; each side with a
#                                           JITATTN_CACHE_DIR of its own (A: $JITATTN_CACHE_DIR, B: its .b)
#
# Timings of A and B come from one machine, minutes apart; run CMD's own interleaved rounds for a
# ratio within one process where a tool has them.
set -euo pipefail
cd "$(dirname "$0")/.."
AB=.ab

case "${1:-}" in
  pack)
    [ $# -eq 2 ] || { echo "usage: tools/ab_trees.sh pack REV" >&2; exit 2; }
    rev=$2
    git rev-parse --verify -q "$rev^{commit}" >/dev/null || { echo "ab_trees: no revision $rev" >&2; exit 2; }
    rm -rf "$AB"
    mkdir -p "$AB/files"
    git rev-parse "$rev" > "$AB/rev"
    : > "$AB/absent"  # paths this tree has and REV does not: removed for B
    paths=$( (git diff --name-only "$rev" -- jitattn templates; git ls-files --others --exclude-standard -- jitattn templates) | sort -u)
    for path in $paths; do
      if git cat-file -e "$rev:$path" 2>/dev/null; then
        mkdir -p "$AB/files/$(dirname "$path")"
        git show "$rev:$path" > "$AB/files/$path"
      else
        echo "$path" >> "$AB/absent"
      fi
    done
    echo "ab_trees: $(find "$AB/files" -type f | wc -l) file(s) as of $(cut -c1-12 "$AB/rev"), $(wc -l < "$AB/absent") absent there, in $AB/"
    ;;
  run)
    shift
    [ $# -gt 0 ] || { echo "usage: tools/ab_trees.sh run CMD..." >&2; exit 2; }
    [ -f "$AB/rev" ] || { echo "ab_trees: no $AB/ here (tools/ab_trees.sh pack REV first)" >&2; exit 2; }
    saved=$(mktemp -d)
    restore() {  # this tree back, whatever B did
      (cd "$saved" && find . -type f) | while read -r f; do mkdir -p "$(dirname "$f")"; cp "$saved/$f" "$f"; done
      (cd "$AB/files" && find . -type f) | while read -r f; do [ -e "$saved/$f" ] || rm -f "$f"; done
      rm -rf "$saved"
    }
    cache=${JITATTN_CACHE_DIR:-/tmp/jitattn-cache}
    echo "== A (this tree)"
    JITATTN_CACHE_DIR=$cache "$@" || echo "ab_trees: A exited $?"
    for f in $( (cd "$AB/files" && find . -type f); cat "$AB/absent"); do
      if [ -e "$f" ]; then mkdir -p "$saved/$(dirname "$f")"; cp "$f" "$saved/$f"; fi
    done
    trap restore EXIT  # from here on this tree's files are in $saved
    (cd "$AB/files" && find . -type f) | while read -r f; do mkdir -p "$(dirname "$f")"; cp "$AB/files/$f" "$f"; done
    while read -r f; do [ -n "$f" ] && rm -f "$f"; done < "$AB/absent"
    echo "== B ($(cut -c1-12 "$AB/rev"))"
    JITATTN_CACHE_DIR=$cache.b "$@" || echo "ab_trees: B exited $?"
    ;;
  *)
    sed -n 2,12p "$0" >&2
    exit 2
    ;;
esac
