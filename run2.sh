export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
SHA=$1
mkdir -p /tmp/ncuhome; export HOME=/tmp/ncuhome TMPDIR=/tmp/ncuhome
for m in 512 2048; do
timeout 90 ncu --clock-control none -k regex:swiglu --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats python3 probe_sw.py $m > $OUT/ncu_swiglu_m$m.txt 2>&1
echo "ncu m=$m rc=$?"; grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Stall|Issued Warp|No Eligible|Eligible Warps|Compute \(SM\)|Mem Busy|Max Bandwidth|L1/TEX Hit|L2 Hit" $OUT/ncu_swiglu_m$m.txt | head -40
done
THR_PROFILE=100:6 OUT=$OUT GIT_SHA=$SHA DEADLINE=500 bash bench/run_h200.sh throughput 2>&1 | tail -20
python3 - <<PY
import json
d=json.load(open("$OUT/throughput.json")); r=d["rows"][-1]
for k in ("output_tokens_per_s","wall_s","steps","step_kinds","host_phases_ms","gpu_clocks","warmup_s"):
    print(k, json.dumps(r.get(k)))
p=r.get("profile")
if p:
    print({k:v for k,v in p.items() if not isinstance(v,(list,dict))})
    for t in p.get("top",[])[:20]: print(t)
PY
