// Rows into a KV cache (kv_cache.wgsl): F32 rows converted to the cache's type, or rows of
// its own type copied as stored (a cache moved to a larger one).

struct RParams {
    units: u32,    // lanes with work: values (blocks of 32 for q8_0), or half-words to copy
    row_len: u32,  // write_rows: values a row; copy_rows: half-words a row
    dst_rows: u32,
    elements: u32, // values in the cache (where the q8_0 scales start)
    src_at: u32,   // copy_rows: the first half-word of the region copied, in src and dst
    dst_at: u32,
    groups_x: u32,
    p7: u32, p8: u32, p9: u32, p10: u32, p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> rp: RParams;

// F32 values (write_rows) or the source cache's words (copy_rows).
@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<atomic<u32>>;
@group(0) @binding(2) var<storage, read> pos: array<i32>;

fn lane_unit(lane: Lane, wg: vec3<u32>) -> u32 {
    return group_index(wg, rp.groups_x) * WG + lane.idx;
}

// Write the low 16 bits of `bits` into half-word h of dst.
fn store_half(h: u32, bits: u32) {
    let shift = 16u * (h & 1u);
    atomicAnd(&dst[h / 2u], ~(0xffffu << shift));
    atomicOr(&dst[h / 2u], (bits & 0xffffu) << shift);
}

// dst[pos[i]] = src[i] for rows of row_len values, a lane a value (a block for q8_0);
// positions outside the dst_rows rows are skipped (a device cannot report them mid-step).
@compute @workgroup_size(WG)
fn write_rows(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let u = lane_unit(lane, wg);
    if u >= rp.units {
        return;
    }
    var size = 1u;
    if KV == KV_Q8_0 {
        size = 32u;
    }
    let per_row = rp.row_len / size;
    let i = u / per_row;
    let p = pos[i];
    if p < 0 || u32(p) >= rp.dst_rows {
        return;
    }
    let s0 = i * rp.row_len + (u % per_row) * size;
    let e = u32(p) * rp.row_len + (u % per_row) * size;
    if KV == KV_Q8_0 {
        var x: array<f32, 32>;
        for (var j = 0u; j < 32u; j++) {
            x[j] = bitcast<f32>(src[s0 + j]);
        }
        let b = q8_block(x);
        for (var w = 0u; w < 8u; w++) {
            atomicStore(&dst[e / 4u + w], b.qs[w]);
        }
        store_half(rp.elements / 2u + e / 32u, b.d);
        return;
    }
    let x = bitcast<f32>(src[s0]);
    if KV == KV_F32 {
        atomicStore(&dst[e], bitcast<u32>(x));
    } else if KV == KV_F16 {
        store_half(e, f16_bits(x));
    } else {
        store_half(e, bf16_bits(x));
    }
}

// Half-words of one region of a cache (all of it, or a q8_0 cache's quants, then its
// scales): row i's row_len half-words from src_at + i · row_len to dst_at + pos[i] · row_len.
@compute @workgroup_size(WG)
fn copy_rows(lane: Lane, @builtin(workgroup_id) wg: vec3<u32>) {
    let u = lane_unit(lane, wg);
    if u >= rp.units {
        return;
    }
    let i = u / rp.row_len;
    let p = pos[i];
    if p < 0 || u32(p) >= rp.dst_rows {
        return;
    }
    let h = rp.src_at + u;
    let bits = src[h / 2u] >> (16u * (h & 1u));
    store_half(rp.dst_at + u32(p) * rp.row_len + u % rp.row_len, bits);
}
