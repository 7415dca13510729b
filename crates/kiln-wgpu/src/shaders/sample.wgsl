// One draw of the next token from a row of the logits, as kiln_core::sampling::pick
// does it (repetition penalty, top-k, top-p and min-p at temperature 1, then the
// temperature and the draw), so that only the id goes back to the host. One workgroup of
// WG lanes a draw; top-k at most WG (one candidate a lane). `sample_rows` draws one row or
// a server's batch, a workgroup a draw with the settings of its record.
//
// The k best are found without sorting the vocabulary: a radix select over order-preserving
// 32-bit keys (4 passes of 8 bits) gives the k-th largest value, ties at it going to the
// lowest ids as in the reference's order (logit, then id). Only those k are sorted
// (bitonic, in workgroup memory). Probabilities are f32 here, f64 in the reference: a draw
// within ~1e-6 of a boundary between two candidates may pick the other.

struct SParams {
    vocab: u32,
    p1: u32, p2: u32, p3: u32, p4: u32, p5: u32, p6: u32, p7: u32,
    p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> sp: SParams;

@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<storage, read> penalized: array<i32>;
@group(0) @binding(2) var<storage, read_write> out: array<i32>;
// DRAW_WORDS words a draw, as `Draw` (floats as their bits).
@group(0) @binding(3) var<storage, read> draws: array<u32>;

const DRAW_WORDS: u32 = 9u;

// One draw: its row's first element, its penalized ids penalized[pen0 .. pen0 + n_pen],
// its settings (top_k 1 ..= WG) and where its id goes (its workgroup's index).
struct Draw {
    row0: u32,
    pen0: u32,
    n_pen: u32,
    penalty: f32,
    top_k: u32,
    top_p: f32,
    min_p: f32,
    temperature: f32,
    draw: f32,
    out_at: u32,
}

var<workgroup> hist: array<atomic<u32>, 256>;
var<workgroup> chosen: vec2<u32>; // (prefix, left)
var<workgroup> taken: atomic<u32>;
var<workgroup> cand_l: array<f32, WG>;
var<workgroup> cand_i: array<u32, WG>;
var<workgroup> scan_buf: array<f32, WG>;

// Larger float, larger key.
fn order_key(f: f32) -> u32 {
    let u = bitcast<u32>(f);
    return select(u | 0x80000000u, ~u, (u & 0x80000000u) != 0u);
}

fn logit(row0: u32, i: u32) -> f32 {
    return logits[row0 + i];
}

// Inclusive prefix sum over the workgroup's lanes.
fn scan(v: f32, lid: u32) -> f32 {
    workgroupBarrier();
    scan_buf[lid] = v;
    workgroupBarrier();
    for (var o = 1u; o < WG; o <<= 1u) {
        var add = 0.0;
        if lid >= o {
            add = scan_buf[lid - o];
        }
        workgroupBarrier();
        scan_buf[lid] += add;
        workgroupBarrier();
    }
    return scan_buf[lid];
}

// Does (la, ia) come before (lb, ib)? Larger logit first, then lower id.
fn before(la: f32, ia: u32, lb: f32, ib: u32) -> bool {
    return la > lb || (la == lb && ia < ib);
}

@compute @workgroup_size(WG)
fn sample_rows(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let b = DRAW_WORDS * wg.x;
    draw_one(lane, Draw(draws[b], draws[b + 1u], draws[b + 2u], bitcast<f32>(draws[b + 3u]),
                        draws[b + 4u], bitcast<f32>(draws[b + 5u]), bitcast<f32>(draws[b + 6u]),
                        bitcast<f32>(draws[b + 7u]), bitcast<f32>(draws[b + 8u]), wg.x));
}

fn draw_one(lane: Lane, d: Draw) {
    let tid = lane.idx;
    let vocab = sp.vocab;
    let k = d.top_k;
    let row0 = d.row0;
    // Repetition penalty, in place (the ids are distinct).
    if d.penalty != 1.0 {
        for (var i = tid; i < d.n_pen; i += WG) {
            let t = penalized[d.pen0 + i];
            if t >= 0 && u32(t) < vocab {
                let l = logit(row0, u32(t));
                logits[row0 + u32(t)] = select(l * d.penalty, l / d.penalty, l > 0.0);
            }
        }
    }
    storageBarrier();
    workgroupBarrier();

    // The k-th largest key, digit by digit from the top.
    var prefix = 0u;
    var mask = 0u;
    var left = k;
    for (var shift = 24i; shift >= 0i; shift -= 8i) {
        atomicStore(&hist[tid], 0u);
        workgroupBarrier();
        for (var i = tid; i < vocab; i += WG) {
            let key = order_key(logit(row0, i));
            if (key & mask) == prefix {
                atomicAdd(&hist[(key >> u32(shift)) & 255u], 1u);
            }
        }
        workgroupBarrier();
        if tid == 0u {
            var above = 0u;
            var d = 255u;
            for (; d > 0u; d--) {
                let h = atomicLoad(&hist[d]);
                if above + h >= left {
                    break;
                }
                above += h;
            }
            chosen = vec2<u32>(prefix | (d << u32(shift)), left - above);
        }
        workgroupBarrier();
        prefix = chosen.x;
        left = chosen.y;
        mask |= 255u << u32(shift);
        workgroupBarrier();
    }
    // `prefix` is the k-th largest key; `left` of the logits equal to it are taken, the
    // lowest ids: each lane walks a contiguous span, and a scan of tie counts ranks them.
    let span = (vocab + WG - 1u) / WG;
    let lo = min(tid * span, vocab);
    let hi = min(lo + span, vocab);
    var ties = 0u;
    for (var i = lo; i < hi; i++) {
        ties += u32(order_key(logit(row0, i)) == prefix);
    }
    var rank = u32(scan(f32(ties), tid)) - ties;
    if tid == 0u {
        atomicStore(&taken, 0u);
    }
    workgroupBarrier();
    for (var i = lo; i < hi; i++) {
        let key = order_key(logit(row0, i));
        var take = key > prefix;
        if key == prefix {
            take = rank < left;
            rank++;
        }
        if take {
            let slot = atomicAdd(&taken, 1u);
            if slot < WG {
                cand_l[slot] = logit(row0, i);
                cand_i[slot] = i;
            }
        }
    }
    workgroupBarrier();
    if tid >= k {
        cand_l[tid] = -3.4028235e38;
        cand_i[tid] = 0xFFFFFFFFu;
    }
    workgroupBarrier();
    // Bitonic sort of the WG slots, best first.
    for (var size = 2u; size <= WG; size <<= 1u) {
        for (var stride = size >> 1u; stride > 0u; stride >>= 1u) {
            let j = tid ^ stride;
            if j > tid {
                let la = cand_l[tid];
                let lb = cand_l[j];
                let ia = cand_i[tid];
                let ib = cand_i[j];
                var swap: bool;
                if (tid & size) == 0u {
                    swap = before(lb, ib, la, ia);
                } else {
                    swap = before(la, ia, lb, ib);
                }
                if swap {
                    cand_l[tid] = lb;
                    cand_l[j] = la;
                    cand_i[tid] = ib;
                    cand_i[j] = ia;
                }
            }
            workgroupBarrier();
        }
    }

    // Probabilities at temperature 1, relative to the best (whose weight is 1).
    let best = cand_l[0];
    let mine = tid < k;
    var e = 0.0;
    if mine {
        e = exp(cand_l[tid] - best);
    }
    let cum = scan(e, tid);
    let total = scan_buf[k - 1u];
    var keep = k;
    if d.top_p < 1.0 {
        // The first candidate whose cumulative probability reaches top_p ends the set.
        let below = u32(wg_sum(select(0.0, 1.0, mine && cum < d.top_p * total), lane));
        keep = min(below + 1u, k);
    }
    if d.min_p > 0.0 {
        let above = u32(wg_sum(select(0.0, 1.0, tid < keep && e >= d.min_p), lane));
        keep = max(min(above, keep), 1u);
    }
    // The draw at the temperature: the first candidate whose cumulative weight passes it.
    var t = 0.0;
    if tid < keep {
        t = exp((cand_l[tid] - best) / d.temperature);
    }
    let tcum = scan(t, tid);
    let ttotal = scan_buf[keep - 1u];
    let passed = u32(wg_sum(select(0.0, 1.0, tid < keep && tcum <= d.draw * ttotal), lane));
    if tid == 0u {
        out[d.out_at] = i32(cand_i[min(passed, keep - 1u)]);
    }
}
