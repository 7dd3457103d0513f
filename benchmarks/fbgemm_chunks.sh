#!/usr/bin/env bash
# FBGEMM 1.6.0 for the GPU machine in chunks that fit one device call beside this checkout: runs
# ../shared/fbgemm/prepare.sh (its 50 MB chunks do not fit the 64 MiB upload beside the tree), keeps only the
# sm_90 cubins of its libraries (`benchmarks/fatbin_strip.py`: the H100 and H200 run nothing else; the archive
# goes from 149 to ~55 MB), then splits the archive into equal chunks under .fbgemm/1 .. .fbgemm/n (.fbgemm-inf/
# with --inference; git-ignored), each with stash.sh. The chunk size is derived from the tree: 64 MiB less the
# tracked files less 2 MB of margin (the tree grew from ~17 MB to 25.5 MB by session 61, when 41 MB chunks stopped
# fitting).
#   bash benchmarks/fbgemm_chunks.sh [--inference]      (from the repo root; ~6-12 minutes of xz here)
#   bash benchmarks/fbgemm_chunks.sh --resplit DIR      (strip and re-split the chunks already in DIR, in place)
# On a warm device machine, one call per chunk, back to back (each may also run other work after its stash):
#   carry [".fbgemm/k"]:  bash .fbgemm/k/stash.sh; ...
#   last call:            bash .fbgemm/n/stash.sh && source .fbgemm/n/unpack.sh && python3 -m benchmarks ...
set -euo pipefail
work=${TMPDIR:-/tmp}/fbgemm-pack
if [ "${1:-}" = "--resplit" ]; then
  dir=${2:?usage: fbgemm_chunks.sh --resplit DIR}
  mkdir -p "$work" && cat "$dir"/*/part* > "$work/fb.tar.xz"
else
  dir=.fbgemm; [ "${1:-}" = "--inference" ] && dir=.fbgemm-inf
  bash ../shared/fbgemm/prepare.sh "$@"
  [ "$dir" = .fbgemm ] || rm -rf .fbgemm  # prepare.sh's 50 MB chunks of this archive
fi
rm -rf "$work/strip" && mkdir -p "$work/strip" && xz -d -c "$work/fb.tar.xz" | tar x -C "$work/strip"
python3 benchmarks/fatbin_strip.py --keep 90 "$work/strip"
(cd "$work/strip" && tar cf - . | xz -9 -T0 > "$work/fb.tar.xz") && rm -rf "$work/strip"
total=$(stat -c %s "$work/fb.tar.xz")
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
room=$((64 * 1048576 - tree - 2000000))
[ "$room" -gt 4000000 ] || { echo "the tree ($tree bytes) leaves no room for a chunk in a 64 MiB upload"; exit 1; }
n=$(((total + room - 1) / room)); size=$(((total + n - 1) / n))
rm -rf "$dir" "$work/split" && mkdir -p "$work/split"
(cd "$work/split" && split -b "$size" -d "$work/fb.tar.xz" part)
k=0
for p in "$work"/split/part*; do
  k=$((k + 1)); mkdir -p "$dir/$k"; mv "$p" "$dir/$k/"
  printf '#!/usr/bin/env bash\nmkdir -p /tmp/fbparts && cp "$(dirname "$0")"/part* /tmp/fbparts/\n' > "$dir/$k/stash.sh"
done
cat > "$dir/$k/unpack.sh" <<'EOT'
# source me on the device after the last stash.sh
if [ ! -d /tmp/fbsite/fbgemm_gpu ]; then
  mkdir -p /tmp/fbsite && cat /tmp/fbparts/part* | xz -d -T8 | tar x -C /tmp/fbsite || echo "FBGEMM unpack failed: were all chunks stashed on this machine?"
fi
export PYTHONPATH=/tmp/fbsite${PYTHONPATH:+:$PYTHONPATH}
EOT
echo "FBGEMM in $k chunk(s) of $size bytes under $dir/ (tree $tree bytes)"; ls -la "$dir"/*
