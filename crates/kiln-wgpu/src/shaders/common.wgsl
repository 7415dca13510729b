// Shared by every kernel.

// The flat index of this invocation's workgroup for dispatches laid out as (x, y) with
// at most `max_groups` per dimension (see `Backend::grid`).
fn group_index(wg: vec3<u32>, groups_x: u32) -> u32 {
    return wg.y * groups_x + wg.x;
}

fn gelu_tanh(x: f32) -> f32 {
    // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), with tanh written out so that large
    // |x| saturates instead of overflowing.
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return 0.5 * x * (1.0 + tanh_stable(u));
}

fn tanh_stable(x: f32) -> f32 {
    let e = exp(-2.0 * abs(x));
    return sign(x) * (1.0 - e) / (1.0 + e);
}
