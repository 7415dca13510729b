#!/usr/bin/env bash
# Issue 19's several-host bootstrap, tested with two kiln processes on one 4-GPU machine
# (each a "host" of 2 GPUs, meeting at 127.0.0.1), on the GPU machine from the
# repository root after `scripts/gpu/pack.sh`:
# 1. llama3-8b split over 4 ranks in 2 processes: both print the table;
# 2. host 1 started with other settings (-n 64): both refuse, saying why;
# 3. host 1 killed while decoding: host 0 ends with an error naming what happened, well
#    within KILN_RANK_TIMEOUT, never a hang.
# `two_hosts.sh 3` runs only the third (any of 1, 2, 3).
set -u
only=${1:-123}
K=$(realpath "${KILN:-.gpu-bin/kiln}")
export K NCCL_NVLS_ENABLE=0
bench() { # port node [bench flags...]
  local port=$1 node=$2; shift 2
  exec "$K" bench --synthetic llama3-8b --type f16 --tp 4 --nnodes 2 \
    --node-rank "$node" --master-addr "127.0.0.1:$port" "$@"
}
export -f bench

if [[ $only == *1* ]]; then
echo "== 1. two hosts of two GPUs"
CUDA_VISIBLE_DEVICES=0,1 timeout 300 bash -c 'bench 29511 0 -p 512 -n 128 -r 2' >/tmp/h0.txt 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=2,3 timeout 300 bash -c 'bench 29511 1 -p 512 -n 128 -r 2' >/tmp/h1.txt 2>&1
r1=$?; wait $p0; r0=$?
echo "exit: host 0 $r0, host 1 $r1"; cat /tmp/h0.txt; echo "-- host 1:"; tail -4 /tmp/h1.txt

fi
if [[ $only == *2* ]]; then
echo "== 2. host 1 with other settings"
CUDA_VISIBLE_DEVICES=0,1 timeout 120 bash -c 'bench 29512 0 -p 512 -n 128 -r 2' >/tmp/h0.txt 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=2,3 timeout 120 bash -c 'bench 29512 1 -p 512 -n 64 -r 2' >/tmp/h1.txt 2>&1
r1=$?; wait $p0; r0=$?
echo "exit: host 0 $r0, host 1 $r1"; tail -2 /tmp/h0.txt; tail -2 /tmp/h1.txt

fi
if [[ $only == *3* ]]; then
echo "== 3. host 1 killed while decoding"
start=$(date +%s)
CUDA_VISIBLE_DEVICES=0,1 KILN_RANK_TIMEOUT=20 timeout 180 bash -c 'bench 29513 0 -p 0 -n 8000 -r 1' >/tmp/h0.txt 2>&1 &
p0=$!
CUDA_VISIBLE_DEVICES=2,3 KILN_RANK_TIMEOUT=20 timeout -s KILL 70 bash -c 'bench 29513 1 -p 0 -n 8000 -r 1' >/tmp/h1.txt 2>&1
echo "host 1 killed after $(( $(date +%s) - start )) s"
wait $p0; r0=$?
echo "host 0 exit $r0 after $(( $(date +%s) - start )) s (124: still running at its own 180 s limit)"
grep -v "^$" /tmp/h0.txt | tail -4
fi
