#!/usr/bin/env bash
# Rebuilds the committed corpus of a fuzz target from what fuzzing found.
#
#   scripts/fuzz-corpus.sh TARGET [MAX]
#
# The inputs of fuzz/corpus/TARGET and of the scratch corpus that
# scripts/fuzz.sh fills (target/fuzz-corpus/TARGET) are merged by libFuzzer
# (-set_cover_merge on coverage edges), then a greedy set cover keeps at most
# MAX of them (default 30), each adding the most edges not yet covered, plus
# every input with a name of its own (regression-*, and the like: crashes
# once found, kept whatever they cover). The result replaces
# fuzz/corpus/TARGET. Needs what scripts/fuzz.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."

t=${1:?usage: scripts/fuzz-corpus.sh TARGET [MAX]}
max=${2:-30}
case $t in ops) san=none ;; *) san=address ;; esac
cargo +nightly fuzz build -s "$san" "$t" >/dev/null
bin=$(find fuzz/target -path "*/release/$t" -type f | head -n 1)
[ -x "$bin" ] || { echo "fuzz-corpus.sh: no binary for $t" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/merged" "$work/named" "$work/picked"
sources=("fuzz/corpus/$t")
[ -d "target/fuzz-corpus/$t" ] && sources+=("target/fuzz-corpus/$t")
# Inputs with names of their own are kept as they are.
find "fuzz/corpus/$t" -type f ! -name 'seed-*' | grep -Ev '/[0-9a-f]{40}$' | while read -r f; do
    cp "$f" "$work/named/"
done
"$bin" -merge=1 -set_cover_merge=1 -use_counters=0 "$work/merged" "${sources[@]}" >"$work/merge.log" 2>&1
# Edges per input (libFuzzer's merge control file: file list, then
# "STARTED i size", "FT i ...", "COV i edge...").
"$bin" -merge=1 -use_counters=0 -merge_control_file="$work/ctl" "$work/picked" "$work/named" "$work/merged" \
    >"$work/ctl.log" 2>&1 || true
rm -rf "$work/picked"
awk -v max="$max" -v named="$work/named/" '
    NR == 1 { n = $1; next }
    NR == 2 { next }
    NR <= n + 2 { path[NR - 3] = $0; next }
    $1 == "COV" {
        i = $2
        for (k = 3; k <= NF; k++) { edges[i] = edges[i] " " $k }
    }
    END {
        # Named inputs first, whatever they add.
        for (i = 0; i < n; i++) {
            if (index(path[i], named) == 1) {
                print path[i]
                m = split(edges[i], e, " ")
                for (k = 1; k <= m; k++) covered[e[k]] = 1
                used[i] = 1
            }
        }
        for (round = 0; round < max; round++) {
            best = -1; gain = 0
            for (i = 0; i < n; i++) {
                if (used[i]) continue
                m = split(edges[i], e, " ")
                g = 0
                for (k = 1; k <= m; k++) if (!(e[k] in covered)) g++
                if (g > gain) { gain = g; best = i }
            }
            if (best < 0) break
            print path[best]
            used[best] = 1
            m = split(edges[best], e, " ")
            for (k = 1; k <= m; k++) covered[e[k]] = 1
        }
    }' "$work/ctl" >"$work/keep"
rm -rf "fuzz/corpus/$t.new"
mkdir -p "fuzz/corpus/$t.new"
while read -r f; do cp "$f" "fuzz/corpus/$t.new/"; done <"$work/keep"
rm -rf "fuzz/corpus/$t"
mv "fuzz/corpus/$t.new" "fuzz/corpus/$t"
echo "fuzz-corpus.sh: fuzz/corpus/$t now holds $(find "fuzz/corpus/$t" -type f | wc -l) inputs" \
    "($(du -sk "fuzz/corpus/$t" | cut -f1) KiB; merge: $(tail -n 1 "$work/merge.log"))"
