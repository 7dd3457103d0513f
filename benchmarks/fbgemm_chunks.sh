#!/usr/bin/env bash
# FBGEMM 1.6.0 for the GPU machine in chunks that fit one device call beside this checkout: runs
# ../shared/fbgemm/prepare.sh (50 MB chunks, which no longer fit the 64 MiB upload beside the ~17 MB tree),
# then re-splits its archive into 41 MB chunks under .fbgemm/1 .. .fbgemm/n (git-ignored), each with stash.sh.
#   bash benchmarks/fbgemm_chunks.sh [--inference]      (from the repo root; ~4-10 minutes of xz here)
# On a warm device machine, one call per chunk, back to back (each may also run other work after its stash):
#   carry [".fbgemm/k", ...]:  bash .fbgemm/k/stash.sh; ...
#   last call:                 bash .fbgemm/n/stash.sh && source .fbgemm/n/unpack.sh && python3 -m benchmarks ...
set -euo pipefail
bash ../shared/fbgemm/prepare.sh "$@"
work=${TMPDIR:-/tmp}/fbgemm-pack
rm -rf .fbgemm "$work"/part* && mkdir -p "$work/split"
(cd "$work/split" && rm -f part* && split -b 41000000 -d "$work/fb.tar.xz" part)
n=0
for p in "$work"/split/part*; do
  n=$((n + 1)); mkdir -p ".fbgemm/$n"; mv "$p" ".fbgemm/$n/"
  printf '#!/usr/bin/env bash\nmkdir -p /tmp/fbparts && cp "$(dirname "$0")"/part* /tmp/fbparts/\n' > ".fbgemm/$n/stash.sh"
done
cat > ".fbgemm/$n/unpack.sh" <<'EOT'
# source me on the device after the last stash.sh
if [ ! -d /tmp/fbsite/fbgemm_gpu ]; then
  mkdir -p /tmp/fbsite && cat /tmp/fbparts/part* | xz -d -T8 | tar x -C /tmp/fbsite || echo "FBGEMM unpack failed: were all chunks stashed on this machine?"
fi
export PYTHONPATH=/tmp/fbsite${PYTHONPATH:+:$PYTHONPATH}
EOT
echo "FBGEMM in $n chunk(s) of 41 MB under .fbgemm/"; ls -la .fbgemm/*
