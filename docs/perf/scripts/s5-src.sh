set -u
bash .gpu/run.sh bench --gemm --kernels NONE >/dev/null 2>&1
CUBECL_DEBUG_LOG="$OUT/cubecl-full.log" timeout -s KILL 60 bash .gpu/run.sh bench --gemm --kernels Wgmma,WgmmaCluster2x1 > "$OUT/gemm.log" 2>&1
ls -la "$OUT"
python3 - "$OUT/cubecl-full.log" "$OUT/gemm-src.log" <<'PY'
import sys, re
s = open(sys.argv[1], errors="replace").read()
out = []
i = 0
while True:
    i = s.find("gemm_kernel", i)
    if i < 0: break
    out.append(s[max(0, i - 3000): i + 40000]); i += 40000
open(sys.argv[2], "w").write("\n=====\n".join(out[:4]))
PY
rm "$OUT/cubecl-full.log"; grep -c . "$OUT/gemm-src.log"
