// One draw of the next token from a row of the logits, as kiln_core::sampling::pick
// does it (repetition penalty, top-k, top-p and min-p at temperature 1, then the
// temperature and the draw), so that only the id goes back to the host. One workgroup of
// WG lanes a draw; `sample_rows` draws one row or a server's batch, a workgroup a draw
// with the settings of its record.
//
// Top-k up to WG (one candidate a lane): the k best are found without sorting the
// vocabulary: a radix select over order-preserving 32-bit keys (4 passes of 8 bits) gives
// the k-th largest value, ties at it going to the lowest ids as in the reference's order
// (logit, then id). Only those k are sorted (bitonic, in workgroup memory).
// Top-k off or past WG: see draw_full. Probabilities are f32 here, f64 in the reference:
// a draw within ~1e-6 of a boundary between two candidates may pick the other.

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
// draw_full's: the least key min-p keeps, the id nth_with_key finds, and the settings
// that decide which passes run, loaded so that every lane sees them as uniform.
var<workgroup> min_key: atomic<u32>;
var<workgroup> nth_found: u32;
var<workgroup> uniform_k: u32;
var<workgroup> uniform_p: vec2<f32>;

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
    if tid == 0u {
        uniform_k = d.top_k;
        uniform_p = vec2<f32>(d.top_p, d.min_p);
    }
    let k = workgroupUniformLoad(&uniform_k);
    if k >= 1u && k <= WG {
        draw_top_k(lane, d, k);
    } else {
        draw_full(lane, d, k);
    }
}

// The k-th largest key of the row (1 <= k <= vocab), and how many of the logits equal to
// it are among the k: digit by digit from the top.
fn kth_key(lane: Lane, row0: u32, vocab: u32, k: u32) -> vec2<u32> {
    let tid = lane.idx;
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
    return vec2<u32>(prefix, left);
}

fn draw_top_k(lane: Lane, d: Draw, k: u32) {
    let tid = lane.idx;
    let vocab = sp.vocab;
    let row0 = d.row0;
    let kth = kth_key(lane, row0, vocab, k);
    let prefix = kth.x;
    let left = kth.y;
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

// ---- Draws over the whole vocabulary (top-k off, or past WG) ----
//
// Nothing is sorted. A prefix of the reference's order (larger logit first, lower id first
// among equals) is named by a key and a count of ties: every logit with a larger key, then
// the first `ties` ids whose key is `key`. Top-k, top-p and min-p each keep a prefix and
// the shortest wins; the draw walks the kept prefix at the temperature. Where a cumulative
// weight reaches a goal is found by a binary search over the keys, each step a sum over
// the row in a fixed order (the same result every time), and its ties by count.

struct Prefix {
    key: u32,
    ties: u32,
}

// The logit a key stands for (order_key's inverse).
fn key_logit(key: u32) -> f32 {
    return bitcast<f32>(select(~key, key & 0x7fffffffu, (key & 0x80000000u) != 0u));
}

fn shorter(a: Prefix, b: Prefix) -> Prefix {
    if a.key > b.key || (a.key == b.key && a.ties < b.ties) {
        return a;
    }
    return b;
}

// Σ exp((l - best) · s) over the logits of prefix p whose key is at least c.
fn weight_from(lane: Lane, row0: u32, vocab: u32, c: u32, p: Prefix, best: f32, s: f32) -> f32 {
    var sum = 0.0;
    for (var i = lane.idx; i < vocab; i += WG) {
        let l = logit(row0, i);
        let key = order_key(l);
        if key >= c && key > p.key {
            sum += exp((l - best) * s);
        }
    }
    var total = wg_sum(sum, lane);
    if p.ties > 0u && p.key >= c {
        total += f32(p.ties) * exp((key_logit(p.key) - best) * s);
    }
    return total;
}

// How many logits of prefix p have key c.
fn count_key(lane: Lane, row0: u32, vocab: u32, c: u32, p: Prefix) -> u32 {
    var n = 0.0;
    for (var i = lane.idx; i < vocab; i += WG) {
        let key = order_key(logit(row0, i));
        n += select(0.0, 1.0, key == c && key > p.key);
    }
    return select(u32(wg_sum(n, lane)), p.ties, c == p.key);
}

// The n-th id (0-based, in id order; the last one when there are fewer) whose key is
// `key`: each lane walks a contiguous span of ids, and a scan of their counts ranks them.
fn nth_with_key(lane: Lane, row0: u32, vocab: u32, key: u32, n: u32) -> u32 {
    let span = (vocab + WG - 1u) / WG;
    let lo = min(lane.idx * span, vocab);
    let hi = min(lo + span, vocab);
    var mine = 0u;
    for (var i = lo; i < hi; i++) {
        mine += u32(order_key(logit(row0, i)) == key);
    }
    var rank = u32(scan(f32(mine), lane.idx)) - mine;
    let want = min(n, max(u32(scan_buf[WG - 1u]), 1u) - 1u);
    if lane.idx == 0u {
        nth_found = 0u;
    }
    workgroupBarrier();
    for (var i = lo; i < hi; i++) {
        if order_key(logit(row0, i)) == key {
            if rank == want {
                nth_found = i;
            }
            rank++;
        }
    }
    workgroupBarrier();
    return nth_found;
}

// The shortest prefix of p whose weight exp((l - best) · s) reaches `goal` (`strict`:
// passes it), in the reference's order; p itself when its whole weight falls short.
fn weighted_cut(lane: Lane, row0: u32, vocab: u32, p: Prefix, best: f32, s: f32, goal: f32,
                strict: bool) -> Prefix {
    // G(c), the weight of p's logits with key >= c, falls as c grows: the cut's key is the
    // largest c where it still reaches the goal (an existing key of p).
    var lo = p.key;
    var hi = order_key(best);
    let whole = weight_from(lane, row0, vocab, lo, p, best, s);
    for (var step = 0u; step < 32u; step++) {
        let mid = lo + (hi - lo) / 2u + ((hi - lo) & 1u);
        let g = weight_from(lane, row0, vocab, mid, p, best, s);
        if select(g >= goal, g > goal, strict) {
            lo = mid;
        } else {
            hi = mid - 1u;
        }
    }
    // Then as many of its ties (weight w each) as the goal still needs.
    let above = weight_from(lane, row0, vocab, lo + 1u, p, best, s);
    let count = count_key(lane, row0, vocab, lo, p);
    let w = exp((key_logit(lo) - best) * s);
    let q = (goal - above) / w;
    var j = select(ceil(q), floor(q) + 1.0, strict);
    if w == 0.0 {
        j = f32(count);
    }
    var cut = Prefix(lo, u32(clamp(j, 1.0, f32(max(count, 1u)))));
    if !select(whole >= goal, whole > goal, strict) {
        cut = p;
    }
    return cut;
}

fn draw_full(lane: Lane, d: Draw, k: u32) {
    let vocab = sp.vocab;
    let row0 = d.row0;
    var local_best = -3.4028235e38;
    for (var i = lane.idx; i < vocab; i += WG) {
        local_best = max(local_best, logit(row0, i));
    }
    let best = wg_max(local_best, lane);
    // Top-k: the k best (all of them when off: keys above 0, which no number has).
    var kept = Prefix(0u, 0u);
    if k > 0u && k < vocab {
        let kth = kth_key(lane, row0, vocab, k);
        kept = Prefix(kth.x, kth.y);
    }
    let settings = workgroupUniformLoad(&uniform_p);
    // Top-p: the first candidates whose probability (temperature 1) reaches top_p.
    if settings.x < 1.0 {
        let total = weight_from(lane, row0, vocab, kept.key, kept, best, 1.0);
        kept = shorter(kept, weighted_cut(lane, row0, vocab, kept, best, 1.0, settings.x * total, false));
    }
    // Min-p: the candidates whose probability is at least min_p times the best's, every
    // tie of the last one (the best always).
    if settings.y > 0.0 {
        if lane.idx == 0u {
            atomicStore(&min_key, 0xFFFFFFFFu);
        }
        workgroupBarrier();
        var mine = 0xFFFFFFFFu;
        for (var i = lane.idx; i < vocab; i += WG) {
            let l = logit(row0, i);
            if exp(l - best) >= settings.y {
                mine = min(mine, order_key(l));
            }
        }
        atomicMin(&min_key, mine);
        workgroupBarrier();
        let m = atomicLoad(&min_key);
        kept = shorter(kept, Prefix(m, count_key(lane, row0, vocab, m, Prefix(0u, 0u))));
    }
    // The draw at the temperature: the first candidate whose cumulative weight passes it.
    let s = 1.0 / d.temperature;
    let total = weight_from(lane, row0, vocab, kept.key, kept, best, s);
    let at = weighted_cut(lane, row0, vocab, kept, best, s, d.draw * total, true);
    // A prefix without ties (nothing past the best drawn) draws the best.
    let key = select(order_key(best), at.key, at.ties > 0u);
    let id = nth_with_key(lane, row0, vocab, key, max(at.ties, 1u) - 1u);
    if lane.idx == 0u {
        out[d.out_at] = i32(id);
    }
}
