#!/usr/bin/env bash
# The GPU check: on a machine with a GPU and a CUDA build of torch (nvcc of the
# same CUDA major version, NCCL as torch loads it), one command builds pyddp in
# place for the GPUs present, runs the GPU tests, a GPU benchmark sweep, the
# main job and the DDP benchmark on the GPU, then a short pass without MPS,
# and prints a summary last:
#
#     bash tests/gpu/check.sh            # logs in $OUT when set, else a temp dir
#
# It fits in 6 minutes on one H100/H200 with 16 cores: the whole check is
# capped at GPU_CHECK_SECONDS (default CHECK_SECONDS, 345 s), and each step's
# bound shrinks to what is left of the cap, keeping RESERVE_SECONDS for the end
# (stopping the daemon, the summary) and the time an overrun step's stacks and
# stop take (DUMP_SECONDS, GRACE_SECONDS); a step with less than
# MIN_STEP_SECONDS left is not run, and the summary says so.
#
# The ranks (2) share the GPU where there are fewer GPUs than ranks. Their
# kernels then run at once only under NVIDIA's MPS daemon: without it the two
# processes take turns on the GPU, and every wait between them costs a time
# slice (docs/architecture.md, "Testing with and without a GPU"). So the check
# starts the daemon (`nvidia-cuda-mps-control -d`) when the ranks share a GPU
# and none runs (pgrep finds none), and stops the one it started, and only
# that one, whatever happens (a trap): `quit`, then its pids. A daemon that
# was already running is left alone.
#
# Steps, in order: each one's bound (s), what it does, and its time on an
# H200 with the daemon: the build's and the tests' as measured by an earlier
# check (55 s, 115 s); the sweep's scaled from an 85 s sweep of two cuda_ipc
# peers from 4 KiB to 256 MiB, whose 256 MiB points took most of it; the
# others estimated (the summary gives each step's seconds):
#   machine   20/cmd  GPUs, driver, torch, NCCL, compiler, stack tools      ~5
#   mps-start     30  the daemon, where the ranks share a GPU               ~1
#   build        100  setup.py build_ext --inplace, CUDA forced (an         55
#                     impossible CUDA build fails here, not later)
#   tests        150  pytest -m cuda over tests/ but the torch-named       115
#                     tests, one line per test (a stopped step still
#                     shows what passed), each test bounded by
#                     pytest-timeout when installed
#   torch         60  the torch stack on CUDA tensors: pytest -m cuda -k    ~5
#                     torch (the rest of the GPU tests); skipped, saying
#                     so, where no such test exists
#   sweep         90  pyddp's CUDA transports beside torch's gloo on CUDA  ~40
#                     tensors, NCCL, torch's symm_mem kernels and the
#                     limit_cuda copy, 16 KiB to 64 MiB, results checked;
#                     gloo_cuda and limit_cuda must run, and the ratios
#                     to them go to the summary
#   train         60  examples/train.py --device cuda --epochs 5: the      ~20
#                     ranks placed as the GPUs allow, accuracy >= 90%
#   ddp           60  python -m pyddp.bench ddp --device cuda: the DDP     ~25
#                     overhead ratio, bitwise identical parameters
#   mps-stop      20  the daemon this check started                         ~2
#   nomps-tests   45  without MPS: pytest -m cuda on the cross-rank GPU    ~25
#                     tests NOMPS_TESTS names, each bounded
#   nomps-sweep   40  without MPS: the cuda_ipc peers (there cuda_host),   ~20
#                     all_reduce, 4 KiB to 1 MiB, each collective bounded
#                     (--timeout 20)
# About 310 s in all, 35 s under the cap; the bounds stop a stuck step early,
# the cap keeps the whole within 6 minutes. The pass without MPS runs where
# this check started the daemon and stopped it; where each rank has a GPU of
# its own it is skipped (every step ran without MPS), and where a daemon this
# check did not start was running it is not run, saying why. A step that
# fails or runs over its bound is reported and the next one runs; a failed
# build stops the steps that need it.
#
# A step that runs over its bound has the stacks of its processes dumped
# before it is stopped, into stacks.txt: each thread's kernel wait channel;
# the Python stacks of every Python process it started, through faulthandler,
# which a sitecustomize.py that this script writes (write_python_hook) arms
# on SIGUSR1 in every interpreter started with GPU_CHECK_STACKS set, spawned
# ranks included; and the C++ stacks of those processes through gdb, or
# cuda-gdb where gdb is missing. Then the step's session is ended by pid
# (TERM, then KILL). Only processes this check started are signalled.
#
# What comes back in $OUT (at most 8 files): summary.txt (the machine, the
# table of steps with their verdicts, seconds and numbers, then the sweep's
# ratios), tests.log, sweep.log, stacks.txt when a step ran over, and
# logs.tar.gz with every step's log, the JUnit XML, the sweep's JSON and the
# MPS daemon's log. The summary is also printed last. Its verdict is PASSED
# when every step is ok or skipped for a stated reason (exit status 0),
# INCOMPLETE when the others were not run, FAILED otherwise.

# The steps' ranks: the default of examples/train.py and of both benchmarks.
RANKS=2
# 6 minutes of device time less 15 s for starting the command and fetching $OUT.
CHECK_SECONDS=345
# Stopping the daemon (quit 10 s, 5 s for it to go, stop_tree's grace) and the summary.
RESERVE_SECONDS=20
# Each debugger of an overrun step, all at once: gdb took 1-2 s on a plain Python here;
# loading torch's and CUDA's symbols takes longer, not yet timed on the GPU machine.
DUMP_SECONDS=30
# From TERM to KILL for an overrun step's processes.
GRACE_SECONDS=5
# Less is not enough to start ranks that import torch and make a CUDA context.
MIN_STEP_SECONDS=10
# The main job's final accuracy (%) that the train step asks for.
MIN_ACCURACY=90
# The GPU tests of the pass without MPS: those whose ranks wait for each other, which
# there run the fused programs on the host (cuda_host), and the choice of it.
NOMPS_TESTS="bitwise_identical or stream_semantics or barrier_meets or kernels_take_turns"
MPS_PATTERN='(^|/)nvidia-cuda-mps-control( |$)'
SWEEP_PEERS=nccl,gloo_cuda,pyddp_ipc,pyddp_ipc_registered,pyddp_ipc_two_shot,pyddp_ipc_one_shot
SWEEP_PEERS+=,pyddp_nccl,pyddp_nccl_ring
SWEEP_PEERS+=,symm_mem_one_shot,symm_mem_two_shot,limit_cuda

# --- pieces that read logs (pure: tests/tools/test_gpu_check.py runs them) ----------------------

# pytest_counts LOG: "P passed, F failed, S skipped" (", E errors" when any), from pytest's
# closing line, or from the -v lines of a run stopped before it.
pytest_counts() {
    local log=$1 line kind n
    local -A count=([passed]=0 [failed]=0 [skipped]=0 [error]=0)
    line=$(grep -E '^=+ .*[0-9]+ (passed|failed|skipped|errors?|deselected).* in [0-9.]+s' \
        "$log" | tail -n 1)
    if [[ -n $line ]]; then
        for kind in passed failed skipped error; do
            n=$(grep -oE "[0-9]+ ${kind}s?" <<< "$line" | grep -oE '^[0-9]+' | head -n 1)
            count[$kind]=${n:-0}
        done
    else
        count[passed]=$(grep -cE '::[^ ]+ PASSED' "$log")
        count[failed]=$(grep -cE '::[^ ]+ FAILED' "$log")
        count[skipped]=$(grep -cE '::[^ ]+ SKIPPED' "$log")
        count[error]=$(grep -cE '::[^ ]+ ERROR' "$log")
    fi
    printf '%s passed, %s failed, %s skipped' \
        "${count[passed]}" "${count[failed]}" "${count[skipped]}"
    if (( count[error] > 0 )); then printf ', %s errors' "${count[error]}"; fi
}

# judge_pytest LOG RC [WHY_NONE]: "STATUS<TAB>NUMBERS" of a pytest step; exit status 5 (no
# test collected) is "skipped" with WHY_NONE.
judge_pytest() {
    local log=$1 rc=$2 none=${3:-no test was collected}
    case $rc in
        0) printf 'ok\t%s\n' "$(pytest_counts "$log")" ;;
        5) printf 'skipped\t%s\n' "$none" ;;
        *) printf 'FAILED\t%s (pytest exit %s)\n' "$(pytest_counts "$log")" "$rc" ;;
    esac
}

judge_torch_tests() {
    judge_pytest "$1" "$2" "no CUDA test has 'torch' in its name (pytest -m cuda -k torch)"
}

# judge_sweep LOG RC [REQUIRED_PEER...]: ok when the bench exited 0, found no wrong element
# and ran every REQUIRED_PEER; the numbers name the peers that ran and those skipped, why.
judge_sweep() {
    local log=$1 rc=$2 peer wrong ran skipped missing=""
    shift 2
    wrong=$(sed -n 's/^# wrong elements: \([0-9]*\).*/\1/p' "$log" | tail -n 1)
    ran=$(sed -n 's/^# [a-z_]*  peer: \([a-z_0-9]*\) .*/\1/p' "$log" | awk '!seen[$0]++' |
        paste -sd, -)
    skipped=$(sed -n 's/^# skipped: \([a-z_0-9]*\): \(.*\)/\1 (\2)/p' "$log" | paste -sd';' -)
    for peer in "$@"; do
        if ! grep -q "^# [a-z_]*  peer: $peer " "$log"; then missing+=" $peer"; fi
    done
    local numbers="wrong elements: ${wrong:-unknown}; ran: ${ran:-none}"
    if [[ -n $skipped ]]; then numbers+="; skipped: $skipped"; fi
    if (( rc != 0 )); then
        printf 'FAILED\t%s (bench exit %s)\n' "$numbers" "$rc"
    elif [[ $wrong != 0 ]]; then
        printf 'FAILED\t%s\n' "$numbers"
    elif [[ -n $missing ]]; then
        printf 'FAILED\t%s; did not run:%s\n' "$numbers" "$missing"
    else
        printf 'ok\t%s\n' "$numbers"
    fi
}

judge_main_sweep() { judge_sweep "$1" "$2" gloo_cuda limit_cuda; }

judge_nomps_sweep() { judge_sweep "$1" "$2" pyddp_ipc_two_shot pyddp_ipc_one_shot; }

# judge_train LOG RC GPUS RANKS: ok when train.py exited 0, reached MIN_ACCURACY and, where
# the ranks outnumber the GPUs, said that RANKS ranks share the GPUS GPU(s).
judge_train() {
    local log=$1 rc=$2 gpus=$3 ranks=$4 accuracy placement said numbers good=1
    # train.py's progress bar redraws itself with carriage returns, on the lines it ends.
    accuracy=$(tr '\r' '\n' < "$log" |
        sed -n 's/^final test accuracy: \([0-9.]*\)%.*/\1/p' | tail -n 1)
    if (( gpus < ranks )); then
        placement="$ranks ranks on $gpus GPU(s)"
        said=$placement
    else
        placement="on cuda ($gpus GPU(s)"
        said="$gpus GPU(s) for $ranks ranks"
    fi
    numbers="final accuracy ${accuracy:-none}%"
    if [[ -z $accuracy ]] ||
            ! awk -v a="$accuracy" -v m="$MIN_ACCURACY" 'BEGIN { exit !(a >= m) }'; then
        numbers+=" (needs >= $MIN_ACCURACY%)"
        good=0
    fi
    if grep -qF "$placement" "$log"; then
        numbers+="; $said"
    else
        numbers+="; no line says \"$placement\""
        good=0
    fi
    if (( rc != 0 )); then
        printf 'FAILED\t%s (exit %s)\n' "$numbers" "$rc"
    elif (( good == 0 )); then
        printf 'FAILED\t%s\n' "$numbers"
    else
        printf 'ok\t%s\n' "$numbers"
    fi
}

judge_check_train() { judge_train "$1" "$2" "$gpus" "$RANKS"; }

# judge_ddp LOG RC: ok when the DDP benchmark exited 0 with bitwise identical parameters;
# the numbers are pyddp's overhead over torch DDP's and what torch DDP ran over.
judge_ddp() {
    local log=$1 rc=$2 ratio identical torch_over numbers
    ratio=$(awk '/^pyddp DDP \(/ { print $NF }' "$log" | tail -n 1)
    identical=$(sed -n 's/^pyddp parameters bitwise identical on every rank: //p' "$log" |
        tail -n 1)
    torch_over=$(sed -n 's/^torch DDP: over \([a-z]*\).*/\1/p' "$log" | tail -n 1)
    numbers="overhead / torch DDP's ${ratio:-none}; bitwise identical: ${identical:-unknown}"
    if [[ -n $torch_over ]]; then numbers+="; torch DDP over $torch_over"; fi
    if (( rc != 0 )); then
        printf 'FAILED\t%s (exit %s)\n' "$numbers" "$rc"
    elif [[ $identical != yes ]]; then
        printf 'FAILED\t%s\n' "$numbers"
    else
        printf 'ok\t%s\n' "$numbers"
    fi
}

judge_build() {
    if (( $2 == 0 )); then printf 'ok\t\n'; else printf 'FAILED\tsetup.py exit %s\n' "$2"; fi
}

# sweep_ratios LOG: the sweep's summaries on CUDA (speed-up over each reference peer:
# reference time / peer time, per op and size), as the bench printed them.
sweep_ratios() {
    awk '/^# summary: .* on cuda, / { on = 1 } on && /^$/ { on = 0; print "" } on' "$1"
}

# print_summary STEPS CAP ELAPSED: the table of STEPS (lines "name<TAB>status<TAB>seconds
# <TAB>numbers") and the verdict: PASSED when every step is ok or skipped, INCOMPLETE when
# the others were only not run, else FAILED; exit status 0 when PASSED.
print_summary() {
    local steps=$1 cap=$2 elapsed=$3 name status secs numbers failed=0 not_run=0
    printf '%-12s %-10s %5s  %s\n' step verdict secs numbers
    while IFS=$'\t' read -r name status secs numbers; do
        printf '%-12s %-10s %5s  %s\n' "$name" "$status" "$secs" "$numbers"
        case $status in
            ok | skipped) ;;
            "not run") not_run=$((not_run + 1)) ;;
            *) failed=$((failed + 1)) ;;
        esac
    done < "$steps"
    if (( failed > 0 )); then
        printf 'verdict: FAILED, %s step(s) failed or ran over, %s not run (%s s of %s s)\n' \
            "$failed" "$not_run" "$elapsed" "$cap"
    elif (( not_run > 0 )); then
        printf 'verdict: INCOMPLETE, %s step(s) not run, the others ok (%s s of %s s)\n' \
            "$not_run" "$elapsed" "$cap"
    else
        printf 'verdict: PASSED, every step ok or skipped as stated (%s s of %s s)\n' \
            "$elapsed" "$cap"
    fi
    (( failed + not_run == 0 ))
}

# gpu_count: the GPUs this machine's processes see (CUDA_VISIBLE_DEVICES, when set, narrows
# nvidia-smi's list).
gpu_count() {
    local listed
    listed=$(timeout 20 nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [[ -v CUDA_VISIBLE_DEVICES ]]; then
        local visible
        visible=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
        if (( visible < listed )); then listed=$visible; fi
    fi
    echo "$listed"
}

# --- processes -----------------------------------------------------------------------------

# process_tree PID: PID, its descendants and the rest of its process group (a rank whose
# parent died stays in the group), one per line, read from /proc.
process_tree() {
    local root=$1 stat line pid ppid pgrp rest
    local -A children=() seen=()
    local -a group=() queue=("$root") found=() kids=()
    for stat in /proc/[0-9]*/stat; do
        { read -r line < "$stat"; } 2>/dev/null || continue
        pid=${line%% *}
        rest=${line##*) }
        read -r _ ppid pgrp _ <<< "$rest"
        children[$ppid]+=" $pid"
        if [[ $pgrp == "$root" ]]; then group+=("$pid"); fi
    done
    while (( ${#queue[@]} > 0 )); do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        if [[ -n ${seen[$pid]:-} || ! -d /proc/$pid ]]; then continue; fi
        seen[$pid]=1
        found+=("$pid")
        read -ra kids <<< "${children[$pid]:-}"
        queue+=("${kids[@]}")
    done
    for pid in "${group[@]}"; do
        if [[ -z ${seen[$pid]:-} ]]; then seen[$pid]=1; found+=("$pid"); fi
    done
    if (( ${#found[@]} > 0 )); then printf '%s\n' "${found[@]}"; fi
}

# alive PID: whether PID runs (a zombie does not).
alive() {
    local line
    { read -r line < "/proc/$1/stat"; } 2>/dev/null || return 1
    line=${line##*) }
    [[ ${line:0:1} != Z ]]
}

# stop_tree PID: TERM to PID's tree (process_tree), then KILL to what is left after
# GRACE_SECONDS; CONT first, in case a debugger left one stopped.
stop_tree() {
    local root=$1 pid i left
    local -a pids=()
    mapfile -t pids < <(process_tree "$root")
    if (( ${#pids[@]} == 0 )); then return 0; fi
    kill -CONT "${pids[@]}" 2>/dev/null
    kill -TERM "${pids[@]}" 2>/dev/null
    for (( i = 0; i < GRACE_SECONDS * 2; i++ )); do
        left=0
        for pid in "${pids[@]}"; do if alive "$pid"; then left=1; fi; done
        if (( left == 0 )); then return 0; fi
        sleep 0.5
    done
    mapfile -t -O "${#pids[@]}" pids < <(process_tree "$root")
    kill -KILL "${pids[@]}" 2>/dev/null
    return 0
}

# write_python_hook DIR: a sitecustomize.py in DIR that, in every interpreter started with
# GPU_CHECK_STACKS set and DIR first on PYTHONPATH, registers faulthandler on SIGUSR1 to
# write all threads' stacks to GPU_CHECK_STACKS/python-PID.txt (the file also marks the
# process as one that SIGUSR1 does not kill), then runs the sitecustomize it shadows.
write_python_hook() {
    mkdir -p "$1"
    cat > "$1/sitecustomize.py" <<'EOF'
"""Written by tests/gpu/check.sh: lets the GPU check dump this interpreter's stacks."""
import faulthandler
import importlib.machinery
import importlib.util
import os
import signal
import sys

_folder = os.environ.get("GPU_CHECK_STACKS")
if _folder:
    try:
        _stacks = open(os.path.join(_folder, f"python-{os.getpid()}.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    except (OSError, RuntimeError, ValueError):
        pass

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
EOF
}

# dump_stacks NAME PID FILE: appends to FILE the processes of PID's tree with each thread's
# kernel wait channel, the Python stacks of those armed by the hook, and the C++ stacks of
# those through gdb or cuda-gdb, each debugger bounded by DUMP_SECONDS.
dump_stacks() {
    local name=$1 root=$2 file=$3 pid task tool
    local -a pids=() pythons=() debuggers=()
    mapfile -t pids < <(process_tree "$root")
    {
        printf '===== %s ran over its bound: its processes, %s UTC\n' "$name" \
            "$(date -u '+%F %T')"
        for pid in "${pids[@]}"; do
            printf -- '--- pid %s: %s\n' "$pid" "$(tr '\0' ' ' < "/proc/$pid/cmdline")"
            for task in /proc/"$pid"/task/*; do
                printf '    thread %s %s: waits in %s\n' "${task##*/}" "$(< "$task/comm")" \
                    "$(< "$task/wchan")"
            done
        done
    } >> "$file" 2>/dev/null
    # A file names a pid the hook armed; the pid may since have gone to another program,
    # which SIGUSR1 would end, so it must still run a Python.
    for pid in "${pids[@]}"; do
        if [[ -f $GPU_CHECK_STACKS/python-$pid.txt && $(readlink "/proc/$pid/exe") == *python* ]] &&
                kill -USR1 "$pid" 2>/dev/null; then
            pythons+=("$pid")
        fi
    done
    if (( ${#pythons[@]} == 0 )); then
        echo "--- no Python process of this step was armed for a stack dump" >> "$file"
        return 0
    fi
    sleep 1
    for pid in "${pythons[@]}"; do
        printf -- '--- Python stacks of pid %s (faulthandler)\n' "$pid"
        cat "$GPU_CHECK_STACKS/python-$pid.txt"
    done >> "$file"
    tool=$(command -v gdb || command -v cuda-gdb)
    if [[ -z $tool ]]; then
        echo "--- no C++ stacks: neither gdb nor cuda-gdb is installed" >> "$file"
        return 0
    fi
    for pid in "${pythons[@]}"; do
        timeout -k 2 "$DUMP_SECONDS" "$tool" -p "$pid" -batch -nx -iex 'set auto-load off' \
            -ex 'set pagination off' -ex 'thread apply all bt' \
            > "$GPU_CHECK_STACKS/cpp-$pid.txt" 2>&1 &
        debuggers+=("$!")
    done
    for pid in "${debuggers[@]}"; do wait "$pid"; done
    for pid in "${pythons[@]}"; do
        printf -- '--- C++ stacks of pid %s (%s)\n' "$pid" "${tool##*/}"
        cat "$GPU_CHECK_STACKS/cpp-$pid.txt"
    done >> "$file"
}

# --- the check -----------------------------------------------------------------------------

# record NAME STATUS SECONDS NUMBERS...: a row of the summary (the NUMBERS joined by spaces).
record() {
    local name=$1 status=$2 secs=$3
    shift 3
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "$*" >> "$steps"
}

# run_step NAME BOUND JUDGE COMMAND...: runs COMMAND in a session of its own with its output
# in $work/NAME.log, for at most BOUND seconds (less when the check's time runs short);
# JUDGE LOG RC then gives the step's status and numbers. Exit status 0 when it is ok.
run_step() {
    local name=$1 bound=$2 judge=$3 start=$SECONDS left rc verdict status numbers
    shift 3
    local log="$work/$name.log"
    left=$(( deadline - SECONDS - RESERVE_SECONDS - DUMP_SECONDS - GRACE_SECONDS ))
    if (( left < bound )); then bound=$left; fi
    if (( bound < MIN_STEP_SECONDS )); then
        record "$name" "not run" 0 "no time left: the check is capped at $check_seconds s"
        return 1
    fi
    echo "== gpu check: $name (at most $bound s): $*"
    setsid "$@" > "$log" 2>&1 < /dev/null &
    step_pid=$!
    local timed_out=0
    while alive "$step_pid"; do
        if (( SECONDS - start >= bound )); then timed_out=1; break; fi
        sleep 0.5
    done
    if (( timed_out )); then
        dump_stacks "$name" "$step_pid" "$stacks"
        stop_tree "$step_pid"
    fi
    wait "$step_pid"
    rc=$?
    step_pid=
    if (( timed_out )); then rc=124; fi
    tail -n 15 "$log"
    verdict=$("$judge" "$log" "$rc")
    status=${verdict%%$'\t'*}
    numbers=${verdict#*$'\t'}
    if (( timed_out )); then
        status="TIMED OUT"
        numbers="over $bound s, stacks in stacks.txt; $numbers"
    fi
    record "$name" "$status" "$((SECONDS - start))" "$numbers"
    [[ $status == ok ]]
}

machine_facts() {
    timeout 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_mode \
        --format=csv,noheader
    timeout 20 python -c 'import sys, torch; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "nccl",
torch.cuda.nccl.version() if torch.version.cuda else None, "gpus", torch.cuda.device_count())'
    "${CXX:-c++}" --version | head -n 1
    echo "stack tools: gdb $(command -v gdb || echo none), cuda-gdb $(command -v cuda-gdb ||
        echo none)"
}

mps_pids() { pgrep -f "$MPS_PATTERN"; }

# start_mps: starts the daemon where the ranks share a GPU and none runs; sets mps_started.
start_mps() {
    local start=$SECONDS before
    if (( gpus >= RANKS )); then
        record mps-start skipped 0 "$RANKS ranks on $gpus GPUs: each has its own"
        return 0
    fi
    before=$(mps_pids | paste -sd, -)
    if [[ -n $before ]]; then
        mps_before=$before
        record mps-start skipped 0 "a daemon was running already (pid $before): left alone"
        return 0
    fi
    mkdir -p "$work/mps-log"
    if ! CUDA_MPS_LOG_DIRECTORY="$work/mps-log" timeout 15 nvidia-cuda-mps-control -d \
            > "$work/mps-start.log" 2>&1; then
        record mps-start FAILED "$((SECONDS - start))" \
            "nvidia-cuda-mps-control -d: $(tail -n 1 "$work/mps-start.log")"
        return 1
    fi
    mps_started=$(mps_pids | paste -sd' ' -)
    local until=$(( SECONDS + 10 ))
    while (( SECONDS < until )); do
        if echo get_server_list | timeout 5 nvidia-cuda-mps-control >> "$work/mps-start.log" \
                2>&1; then
            record mps-start ok "$((SECONDS - start))" "started the daemon (pid $mps_started)"
            return 0
        fi
        sleep 0.5
    done
    record mps-start FAILED "$((SECONDS - start))" \
        "the daemon (pid ${mps_started:-none}) does not answer get_server_list"
    return 1
}

# stop_mps: stops the daemon this check started (quit, then its pids), and only it.
stop_mps() {
    local start=$SECONDS pid i
    local -a ours=()
    for pid in $mps_started; do mapfile -t -O "${#ours[@]}" ours < <(process_tree "$pid"); done
    echo quit | timeout 10 nvidia-cuda-mps-control >> "$work/mps-stop.log" 2>&1
    for (( i = 0; i < 10; i++ )); do
        local left=0
        for pid in "${ours[@]}"; do if alive "$pid"; then left=1; fi; done
        if (( left == 0 )); then break; fi
        sleep 0.5
    done
    for pid in $mps_started; do stop_tree "$pid"; done
    if (( ${#ours[@]} > 0 )); then kill -KILL "${ours[@]}" 2>/dev/null; fi
    if [[ -n $(mps_pids) ]]; then
        record mps-stop FAILED "$((SECONDS - start))" \
            "a daemon still runs (pid $(mps_pids | paste -sd, -))"
        mps_started=
        return 1
    fi
    record mps-stop ok "$((SECONDS - start))" "stopped the daemon (pid $mps_started)"
    mps_started=
}

finish() {
    local rc=$?
    if [[ -n ${step_pid:-} ]]; then stop_tree "$step_pid"; fi
    if [[ -n ${mps_started:-} ]]; then stop_mps; fi
    if [[ -n ${work:-} && -d $work ]]; then
        tar -czf "$out/logs.tar.gz" -C "$work" --exclude=./hook --exclude=./stacks . 2>/dev/null
        rm -rf "$work"
    fi
    exit "$rc"
}

main() {
    set -uo pipefail
    cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
    check_seconds=${GPU_CHECK_SECONDS:-$CHECK_SECONDS}
    deadline=$(( SECONDS + check_seconds ))
    out="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/pyddp-gpu-check.XXXXXX")}"
    mkdir -p "$out"
    work=$(mktemp -d "${TMPDIR:-/tmp}/pyddp-gpu-check-work.XXXXXX")
    steps="$work/steps.tsv"
    stacks="$out/stacks.txt"
    : > "$steps"
    rm -f "$stacks"
    step_pid=
    mps_started=
    mps_before=
    trap finish EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    export GPU_CHECK_STACKS="$work/stacks"
    mkdir -p "$GPU_CHECK_STACKS"
    write_python_hook "$work/hook"
    export PYTHONPATH="$work/hook${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1

    local start=$SECONDS
    machine_facts > "$work/machine.log" 2>&1
    cat "$work/machine.log"
    gpus=$(gpu_count)
    if (( gpus == 0 )); then
        record machine FAILED "$((SECONDS - start))" "no GPU: nvidia-smi -L lists none"
    else
        record machine ok "$((SECONDS - start))" \
            "$gpus GPU(s): $(timeout 20 nvidia-smi --query-gpu=name --format=csv,noheader |
            sort -u | paste -sd, -); $RANKS ranks"
        start_mps

        local timeout_flag=() nomps_timeout_flag=()
        if python -c 'import pytest_timeout' 2>/dev/null; then
            timeout_flag=(--timeout 90)
            nomps_timeout_flag=(--timeout 30)
        fi
        if run_step build 100 judge_build env PYDDP_BUILD_CUDA=1 \
                MAX_JOBS="${MAX_JOBS:-$(nproc)}" python setup.py build_ext --inplace; then
            # PYDDP_CHECK_MPS: whether the ranks' kernels run at once, for the test of
            # which transport "auto" takes
            run_step tests 150 judge_pytest env ${mps_started:+PYDDP_CHECK_MPS=on} \
                python -m pytest -m cuda tests -k "not torch" -v -rs \
                -p no:cacheprovider "${timeout_flag[@]}" --junitxml "$work/tests.xml"
            run_step torch 60 judge_torch_tests python -m pytest -m cuda tests -k torch -v -rs \
                -p no:cacheprovider "${timeout_flag[@]}" --junitxml "$work/torch.xml"
            run_step sweep 90 judge_main_sweep python -m pyddp.bench --peers "$SWEEP_PEERS" \
                --ops all_reduce,all_gather,broadcast,reduce_scatter -b 16K -e 64M -f 16 \
                --trials 3 --target-time 0.1 -w 2 --check --timeout 60 --quiet \
                --json "$work/sweep.json"
            run_step train 60 judge_check_train python examples/train.py --device cuda --epochs 5
            run_step ddp 60 judge_ddp python -m pyddp.bench ddp --device cuda --rounds 3 \
                --steps 4 --warmup 2 --timeout 60
            if [[ -n $mps_started ]]; then
                if stop_mps; then
                    run_step nomps-tests 45 judge_pytest env PYDDP_CHECK_MPS=off \
                        python -m pytest -m cuda tests \
                        -k "$NOMPS_TESTS" -v -rs -p no:cacheprovider "${nomps_timeout_flag[@]}" \
                        --junitxml "$work/nomps-tests.xml"
                    run_step nomps-sweep 40 judge_nomps_sweep python -m pyddp.bench \
                        --peers pyddp_ipc_two_shot,pyddp_ipc_one_shot --ops all_reduce -b 4K -e 1M \
                        -f 16 --trials 1 --target-time 0.05 -w 1 --check --timeout 20 --quiet
                else
                    record nomps "not run" 0 "the MPS daemon did not stop"
                fi
            elif [[ -n $mps_before ]]; then
                record nomps "not run" 0 "an MPS daemon this check did not start was running" \
                    "(pid $mps_before): stopping it could break its other clients"
            elif (( gpus >= RANKS )); then
                record nomps skipped 0 "each rank has its own GPU: the check ran without MPS"
            else
                record nomps "not run" 0 \
                    "the MPS daemon did not start, so every step above ran without it"
            fi
        else
            record rest "not run" 0 "tests, sweep, train, ddp and the no-MPS pass: the build failed"
        fi
    fi
    if [[ -n $mps_started ]]; then stop_mps; fi

    echo "== gpu check: summary (logs in $out)"
    local verdict=0
    {
        cat "$work/machine.log"
        echo
        print_summary "$steps" "$check_seconds" "$SECONDS"
        if [[ -f $work/sweep.log ]] && [[ -n $(sweep_ratios "$work/sweep.log") ]]; then
            echo
            echo "sweep ratios, same run (reference time / peer time; above 1 is faster):"
            sweep_ratios "$work/sweep.log"
        fi
    } | tee "$out/summary.txt"
    if ! grep -q '^verdict: PASSED' "$out/summary.txt"; then verdict=1; fi
    for log in tests sweep; do
        if [[ -f $work/$log.log ]]; then cp "$work/$log.log" "$out/"; fi
    done
    return "$verdict"
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    main "$@"
fi
