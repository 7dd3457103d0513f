"""Shrink FBGEMM's shared libraries for the GPU machine: zero the device code built for other GPU archs.

fbgemm_gpu 1.6.0's wheel carries each CUDA kernel as cubins for sm_80, sm_90 and sm_100 (no PTX) in every
library's `.nv_fatbin` section (1.05 GB of the 1.16 GB `fbgemm_gpu_tbe_training_backward.so`). The H100 and
H200 run only the sm_90 cubins, so this script rewrites each fatbin container in place to hold its sm_90 entry
alone (the ELF layout and every container's place stay as they were; the freed bytes become zeros, which compress
to nothing). Zeroing the other entries' payloads instead left containers whose listed entries no longer
decompress (`cuobjdump -lelf`: "Uncompress failed"). The
package's xz archive goes from 149 MB to ~55 MB: two device calls' uploads beside this tree instead of four.

A fatbin section holds containers (magic 0xBA55ED50, a 16-byte header: magic u32, version u16, header size u16,
payload size u64); each container holds entries, each a header (kind u16, version u16, header size u32, padded
payload size u32, ..., the SM version u32 at byte 28) followed by its payload.

  python benchmarks/fatbin_strip.py --keep 90 DIR     (every .so under DIR, in place)
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess

MAGIC = 0xBA55ED50


def fatbin_section(path: str) -> tuple[int, int] | None:
    """(file offset, size) of the library's `.nv_fatbin` section, or None."""
    out = subprocess.check_output(["readelf", "-S", "-W", path], text=True)
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()  # name, type, address, offset, size, ...
            return int(fields[3], 16), int(fields[4], 16)
    return None


def strip(path: str, keep: int) -> tuple[int, int]:
    """Keep only the entries of SM version `keep` in each fatbin container of `path`: they move to the front of
    their container, whose header then counts only them, and the container's freed tail becomes zeros (nothing
    reads it: the runtime reaches each container through its pointer in `.nvFatBinSegment`, whose place does not
    change). (bytes of entries kept, bytes dropped)."""
    section = fatbin_section(path)
    if section is None:
        return 0, 0
    start, size = section
    with open(path, "r+b") as fh:
        fh.seek(start)
        data = bytearray(fh.read(size))
        pos, kept, dropped = 0, 0, 0
        while pos + 16 <= size:
            magic, version, header, payload = struct.unpack_from("<IHHQ", data, pos)
            if magic != MAGIC:  # alignment padding, or a tail this script zeroed before
                pos += 8
                continue
            entry, end, keep_bytes = pos + header, pos + header + payload, bytearray()
            while entry < end:
                _, _, entry_header, padded = struct.unpack_from("<HHII", data, entry)
                sm = struct.unpack_from("<I", data, entry + 28)[0]
                nxt = entry + entry_header + padded
                if sm == keep:
                    keep_bytes += data[entry:nxt]
                else:
                    dropped += padded
                entry = nxt
            if entry != end:
                raise ValueError(f"{path}: a fatbin container's entries end at {entry}, not {end}")
            if not keep_bytes:
                raise ValueError(f"{path}: a fatbin container at {start + pos} has no sm_{keep} entry")
            kept += len(keep_bytes)
            struct.pack_into("<IHHQ", data, pos, magic, version, header, len(keep_bytes))
            body = pos + header
            data[body:end] = keep_bytes + bytes(end - body - len(keep_bytes))
            pos = end
        fh.seek(start)
        fh.write(data)
    return kept, dropped


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir")
    ap.add_argument("--keep", type=int, default=90, help="the SM version to keep (90: H100 and H200)")
    args = ap.parse_args(argv)
    for root, _, files in os.walk(args.dir):
        for name in sorted(files):
            if name.endswith(".so"):
                kept, dropped = strip(os.path.join(root, name), args.keep)
                if dropped:
                    print(f"{name}: kept {kept / 1e6:.0f} MB of sm_{args.keep} cubins, dropped {dropped / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
