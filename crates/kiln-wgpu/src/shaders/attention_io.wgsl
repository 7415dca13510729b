// What the attention kernels share (attention.wgsl, attention_coop.wgsl): their parameters,
// bindings, and the caches' values decoded to f32 as they are read.

struct AParams {
    n: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    capacity: u32,
    scale: f32,
    softcap: f32, // 0: none
    window: u32,  // 0: none
    groups_x: u32,
    // A paged cache (a server's batch): query i's position p is pool row
    // tables[seq[i] * max_blocks + p / block] * block + p % block. 0: contiguous.
    max_blocks: u32,
    block: u32,
    p11: u32, p12: u32, p13: u32, p14: u32, p15: u32,
}
@group(1) @binding(0) var<uniform> ap: AParams;

@group(0) @binding(0) var<storage, read> q: array<f32>;
@group(0) @binding(1) var<storage, read> k_cache: array<u32>;
@group(0) @binding(2) var<storage, read> v_cache: array<u32>;
@group(0) @binding(3) var<storage, read> pos: array<i32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> seq: array<i32>;
@group(0) @binding(6) var<storage, read> tables: array<i32>;

// Values in each cache (the q8_0 scales follow them).
fn cache_elements() -> u32 {
    return ap.capacity * ap.kv_heads * ap.head_dim;
}

// Element e of the k cache, as f32.
fn k_at(e: u32) -> f32 {
    var s = 0u;
    if KV == KV_Q8_0 {
        s = k_cache[kv_scale_word(e, cache_elements())];
    }
    return kv_value(e, k_cache[kv_word(e)], s);
}

fn v_at(e: u32) -> f32 {
    var s = 0u;
    if KV == KV_Q8_0 {
        s = v_cache[kv_scale_word(e, cache_elements())];
    }
    return kv_value(e, v_cache[kv_word(e)], s);
}

// A finite "minus infinity": WGSL leaves arithmetic on infinities undefined.
const LOWEST: f32 = -3.4028235e38;
