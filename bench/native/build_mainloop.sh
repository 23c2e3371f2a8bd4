#!/usr/bin/env bash
# Builds the mainloop search (mainloop_search.cu): one object per configuration of CONFIGS below,
# compiled in parallel, with ptxas's resource report of each kept for the record.
#   bash bench/native/build_mainloop.sh BUILD_DIR [NVCC_ARG...]      (run from the repository root)
# Writes BUILD_DIR/mainloop_search and BUILD_DIR/resources.json (registers, spills, shared memory
# per configuration). CUTLASS_PATH: a CUTLASS tree (tools/cutlass_path.sh finds one when unset);
# MAX_JOBS parallel compiles (default: the number of CPUs).
set -euo pipefail
dir=${1:?usage: bash bench/native/build_mainloop.sh BUILD_DIR [NVCC_ARG...]}
shift
source tools/cutlass_path.sh
mkdir -p "$dir"
# name tile_m tile_n tile_k cluster_m cluster_n cooperative stream_k stages epi_n [epilogue]
# (stages 0: as many as fit beside the epilogue's shared memory; epi_n: the epilogue sub-tile's
# columns; epilogue, optional: tma (the default), nosmem (stores from registers) or split_n (the
# warp groups side by side along N, with the nosmem epilogue: mainloop_config.cu). MAINLOOP_CONFIGS,
# when set, replaces the list (the same columns), to build a subset. The first 14 are the library's kind of configuration; the rest search the axes
# #40 names: N tiles that are no power of two (160, 224), 2 x 2 clusters, fewer stages, a wider
# epilogue sub-tile, and a 128-deep K tile.
CONFIGS="
pp_128x128_c1x1 128 128 64 1 1 0 0 0 32
pp_128x128_c2x1 128 128 64 2 1 0 0 0 32
pp_128x128_c1x2 128 128 64 1 2 0 0 0 32
pp_128x192_c2x1 128 192 64 2 1 0 0 0 32
co_128x256_c1x1 128 256 64 1 1 1 0 0 32
co_128x256_c2x1 128 256 64 2 1 1 0 0 32
co_128x256_c1x2 128 256 64 1 2 1 0 0 32
co_256x128_c1x1 256 128 64 1 1 1 0 0 32
co_256x128_c2x1 256 128 64 2 1 1 0 0 32
co_256x128_c1x2 256 128 64 1 2 1 0 0 32
co_128x192_c2x1 128 192 64 2 1 1 0 0 32
co_256x192_c2x1 256 192 64 2 1 1 0 0 32
co_128x256_c2x1_sk 128 256 64 2 1 1 1 0 32
co_256x128_c2x1_sk 256 128 64 2 1 1 1 0 32
pp_128x160_c2x1 128 160 64 2 1 0 0 0 32
co_128x160_c2x1 128 160 64 2 1 1 0 0 32
co_128x224_c2x1 128 224 64 2 1 1 0 0 32
co_256x160_c2x1 256 160 64 2 1 1 0 0 32
co_256x224_c2x1 256 224 64 2 1 1 0 0 32
co_128x256_c2x2 128 256 64 2 2 1 0 0 32
co_256x128_c2x2 256 128 64 2 2 1 0 0 32
co_128x256_c2x1_s3 128 256 64 2 1 1 0 3 32
co_128x256_c2x1_e64 128 256 64 2 1 1 0 0 64
co_256x128_c2x1_e64 256 128 64 2 1 1 0 0 64
pp_128x128_c2x1_k128 128 128 128 2 1 0 0 0 32
co_192x192_c2x1_sn 192 192 64 2 1 1 0 4 32 split_n
co_192x192_c1x2_sn 192 192 64 1 2 1 0 4 32 split_n
co_192x192_c2x1_sn_s3 192 192 64 2 1 1 0 3 32 split_n
co_192x192_c1x2_sn_s3 192 192 64 1 2 1 0 3 32 split_n
co_256x128_c2x1_ns 256 128 64 2 1 1 0 0 32 nosmem
"
CONFIGS=${MAINLOOP_CONFIGS:-$CONFIGS}
common=(-std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
        -I"$CUTLASS_PATH/include" -I"$CUTLASS_PATH/tools/util/include" -Ibench/native -I"$dir" "$@")
: >"$dir/configs.inc"
: >"$dir/jobs.txt"
i=0
while read -r name tm tn tk cm cn coop sk st en epi; do
  [ -n "$name" ] || continue
  [ -n "$en" ] || { echo "CONFIGS line '$name': 10 or 11 columns expected" >&2; exit 2; }
  case "${epi:-tma}" in
    tma) split=0 nosmem=0 ;;
    nosmem) split=0 nosmem=1 ;;
    split_n) split=1 nosmem=1 ;;
    *) echo "CONFIGS line '$name': epilogue must be tma, nosmem or split_n, got '$epi'" >&2; exit 2 ;;
  esac
  echo "ML_CONFIG($i)" >>"$dir/configs.inc"
  echo "$i $name $tm $tn $tk $cm $cn $coop $sk $st $en $split $nosmem" >>"$dir/jobs.txt"
  i=$((i + 1))
done <<<"$CONFIGS"
compile_one() {
  read -r i name tm tn tk cm cn coop sk st en split nosmem <<<"$1"
  nvcc "${common[@]}" -Xptxas -v -DMAINLOOP_CONFIG=$i -DCONFIG_NAME=$name -DTILE_M=$tm -DTILE_N=$tn -DTILE_K=$tk \
    -DCLUSTER_M=$cm -DCLUSTER_N=$cn -DCOOPERATIVE=$coop -DSTREAM_K=$sk -DSTAGES=$st -DEPI_N=$en \
    -DSPLIT_N=$split -DEPI_NOSMEM=$nosmem \
    -c bench/native/mainloop_config.cu \
    -o "$dir/config_$i.o" >"$dir/ptxas_$i.log" 2>&1 || { cat "$dir/ptxas_$i.log" >&2; return 1; }
  echo "built $name"
}
export -f compile_one
export dir
jobs=${MAX_JOBS:-$(nproc)}
# xargs runs compile_one in child shells: hand the array over as a declaration
declare -p common >"$dir/common.sh"
xargs -P "$jobs" -I{} bash -c 'source "$dir/common.sh"; compile_one "$@"' _ {} <"$dir/jobs.txt"
nvcc "${common[@]}" bench/native/mainloop_search.cu "$dir"/config_*.o -lcublasLt -ldl -o "$dir/mainloop_search"
python3 - "$dir" <<'PY'
import json, re, sys, pathlib
d = pathlib.Path(sys.argv[1])
out = {}
for line in (d / "jobs.txt").read_text().splitlines():
    i, name = line.split()[:2]
    log = (d / f"ptxas_{i}.log").read_text()
    kernels = []  # the two kernels of a configuration (B K-major and N-major), in ptxas's order
    for block in re.split(r"Compiling entry function", log)[1:]:
        if "device_kernel" not in block.split("\n")[0]:
            continue
        regs = re.search(r"Used (\d+) registers", block)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        kernels.append({"registers": int(regs.group(1)) if regs else None,
                        "spill_stores": int(spill.group(1)) if spill else None,
                        "spill_loads": int(spill.group(2)) if spill else None})
    out[name] = kernels
(d / "resources.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out))
PY
