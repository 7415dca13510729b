// The optimizer step (kiln_core::optim): a pass over the gradients for their norm and
// inf/NaN (when clipping or loss scaling), a one-thread kernel that prepares the step's
// factors in the control block, and the update, one launch over the flat buffers.
//
// Bit parity with PyTorch's single-tensor path (and with kiln's CPU step) needs every
// rounding where PyTorch has it: the program is compiled with --fmad=true, so each
// operation here is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...),
// which the compiler never contracts, and each fused multiply-add PyTorch's CPU kernels
// make is an explicit __fmaf_rn. The double-precision scalars in optim_prepare follow
// StepControl::prepare (kiln-core/src/optim.rs) operation by operation.

// kiln_core::optim::StepControl, field for field (80 bytes).
struct OptimControl {
    double calls;
    double steps;
    double lr;
    float loss_scale;
    int growth_tracker;
    float grad_norm;
    float clip_coef;
    float inv_scale;
    int skipped;
    float factors[8];
};

// Flags of the update kernels: bits 0-4 for every rule, bits 5-7 the rule's own.
#define OPT_UNSCALE 1
#define OPT_CLIP 2
#define OPT_COPY_BF16 4
#define OPT_COPY_F16 8
#define OPT_VECTOR 16  // every pointer 16-byte aligned: float4 loads and stores
#define OPT_RULE_A 32
#define OPT_RULE_B 64
#define OPT_RULE_C 128

// ---- 1. Gradient statistics. Launch: grid (partials, at most 1024), block 256.
// partial_sums[b] = Σ over block b's share of (g·inv)² (each square an f32, summed in
// f64), partial_bad[b] = whether any g there is inf/NaN. Fixed shares: deterministic.
extern "C" __global__ void optim_grad_stats(const float* g, u64 n, const OptimControl* c,
                                            int unscale, double* partial_sums,
                                            int* partial_bad) {
    follow_previous();
    const float inv = unscale ? (float)(1.0 / (double)c->loss_scale) : 1.0f;
    double sum = 0.0;
    int bad = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = g[i];
        bad |= !isfinite(v);
        if (unscale) v = __fmul_rn(v, inv);
        sum += (double)__fmul_rn(v, v);
    }
    __shared__ double sums[256];
    __shared__ int bads[256];
    sums[threadIdx.x] = sum;
    bads[threadIdx.x] = bad;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            sums[threadIdx.x] += sums[threadIdx.x + s];
            bads[threadIdx.x] |= bads[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial_sums[blockIdx.x] = sums[0];
        partial_bad[blockIdx.x] = bads[0];
    }
}

// ---- 2. The step's factors. Launch: grid 1, block 1.

#define RULE_SGD 0
#define RULE_ADAM 1
#define RULE_RMSPROP 2
#define RULE_ADAGRAD 3
#define SCHED_CONSTANT 0
#define SCHED_LINEAR_WARMUP 1
#define SCHED_COSINE 2
#define SCHED_STEP 3
#define SCHED_ONE_CYCLE 4

#define PI_F64 3.141592653589793

// Schedule::lr, operation by operation.
__device__ double schedule_lr(int kind, const double* s, double k) {
    switch (kind) {
    case SCHED_LINEAR_WARMUP: {  // s: lr, start_factor, warmup
        if (s[2] == 0.0 || k >= s[2]) return s[0];
        const double ramp = __ddiv_rn(__dmul_rn(__dadd_rn(1.0, -s[1]), k), s[2]);
        return __dmul_rn(s[0], __dadd_rn(s[1], ramp));
    }
    case SCHED_COSINE: {  // s: lr, min_lr, warmup, total
        if (k < s[2]) return __ddiv_rn(__dmul_rn(s[0], __dadd_rn(k, 1.0)), s[2]);
        if (k >= s[3]) return s[1];
        const double ratio = __ddiv_rn(__dadd_rn(k, -s[2]), __dadd_rn(s[3], -s[2]));
        const double c = __dadd_rn(1.0, cos(__dmul_rn(PI_F64, ratio)));
        return __dadd_rn(s[1], __ddiv_rn(__dmul_rn(__dadd_rn(s[0], -s[1]), c), 2.0));
    }
    case SCHED_STEP:  // s: lr, step_size, gamma
        return __dmul_rn(s[0], pow(s[2], floor(__ddiv_rn(k, s[1]))));
    case SCHED_ONE_CYCLE: {  // s: max_lr, total, pct_start, div_factor, final_div_factor
        const double initial = __ddiv_rn(s[0], s[3]);
        const double min_lr = __ddiv_rn(initial, s[4]);
        const double end_up = __dadd_rn(__dmul_rn(s[2], s[1]), -1.0);
        const double end_down = __dadd_rn(s[1], -1.0);
        double start, end, pct;
        if (k <= end_up) {
            start = initial; end = s[0]; pct = __ddiv_rn(k, end_up);
        } else if (k <= end_down) {
            start = s[0]; end = min_lr; pct = __ddiv_rn(__dadd_rn(k, -end_up), __dadd_rn(end_down, -end_up));
        } else {
            return min_lr;
        }
        const double cos_out = __dadd_rn(cos(__dmul_rn(PI_F64, pct)), 1.0);
        return __dadd_rn(end, __dmul_rn(__ddiv_rn(__dadd_rn(start, -end), 2.0), cos_out));
    }
    default:  // SCHED_CONSTANT: s: lr
        return s[0];
    }
}

// h: the rule's hyperparameters (see optim.rs), s: the schedule's; max_norm <= 0: no
// clipping; scaling: 0, or 1 with growth, backoff and interval. partials = 0 when the
// gradient pass did not run.
extern "C" __global__ void optim_prepare(OptimControl* c, const double* partial_sums,
                                         const int* partial_bad, int partials, int rule,
                                         double h0, double h1, double h2, double h3, int flags,
                                         int sched, double s0, double s1, double s2, double s3,
                                         double s4, float max_norm, int scaling, float growth,
                                         float backoff, int interval) {
    follow_previous();
    double sum = 0.0;
    int bad = 0;
    for (int i = 0; i < partials; i++) {
        sum = __dadd_rn(sum, partial_sums[i]);
        bad |= partial_bad[i];
    }
    c->inv_scale = scaling ? (float)__ddiv_rn(1.0, (double)c->loss_scale) : 1.0f;
    c->grad_norm = partials > 0 ? (float)__dsqrt_rn(sum) : 0.0f;
    if (max_norm > 0.0f) {
        const float coef = __fmul_rn(__fdiv_rn(1.0f, __fadd_rn(c->grad_norm, 1e-6f)), max_norm);
        c->clip_coef = coef > 1.0f ? 1.0f : coef;
    } else {
        c->clip_coef = 1.0f;
    }
    const int found_inf = scaling && bad;
    const double k = c->calls;
    c->calls = __dadd_rn(k, 1.0);
    if (scaling) {
        if (found_inf) {
            c->loss_scale = __fmul_rn(c->loss_scale, backoff);
            c->growth_tracker = 0;
        } else {
            const int successful = c->growth_tracker + 1;
            if (successful == interval) {
                const float grown = __fmul_rn(c->loss_scale, growth);
                if (isfinite(grown)) c->loss_scale = grown;
                c->growth_tracker = 0;
            } else {
                c->growth_tracker = successful;
            }
        }
    }
    c->skipped = found_inf;
    if (found_inf) return;
    const double t = __dadd_rn(c->steps, 1.0);
    c->steps = t;
    const double sp[5] = {s0, s1, s2, s3, s4};
    const double lr = schedule_lr(sched, sp, k);
    c->lr = lr;
    float* f = c->factors;
    for (int i = 0; i < 8; i++) f[i] = 0.0f;
    switch (rule) {
    case RULE_SGD:  // h: momentum, dampening, weight_decay
        f[0] = (float)h2; f[1] = (float)h0; f[2] = (float)__dadd_rn(1.0, -h1); f[3] = (float)-lr;
        f[4] = t == 1.0 ? 1.0f : 0.0f;
        break;
    case RULE_ADAM: {  // h: beta1, beta2, eps, weight_decay; flags & 1: decoupled
        const double step_size = __ddiv_rn(lr, __dadd_rn(1.0, -pow(h0, t)));
        const double decay = (flags & 1) ? __dadd_rn(1.0, -__dmul_rn(lr, h3)) : h3;
        f[0] = (float)__dadd_rn(1.0, -h0); f[1] = (float)h1; f[2] = (float)__dadd_rn(1.0, -h1);
        f[3] = (float)__dsqrt_rn(__dadd_rn(1.0, -pow(h1, t))); f[4] = (float)h2;
        f[5] = (float)-step_size; f[6] = (float)decay;
        break;
    }
    case RULE_RMSPROP:  // h: alpha, eps, weight_decay, momentum
        f[0] = (float)h2; f[1] = (float)h0; f[2] = (float)__dadd_rn(1.0, -h0); f[3] = (float)h1;
        f[4] = (float)h3; f[5] = (float)-lr;
        break;
    default: {  // RULE_ADAGRAD: h: lr_decay, weight_decay, eps
        const double clr = __ddiv_rn(lr, __dadd_rn(1.0, __dmul_rn(__dadd_rn(t, -1.0), h0)));
        f[0] = (float)h1; f[1] = (float)h2; f[2] = (float)-clr;
        break;
    }
    }
}

// ---- 3. The update. Launch: 1-D, block 256, each thread 4 consecutive elements.

__device__ __forceinline__ float lerp_torch(float start, float end, float w) {
    const float d = __fsub_rn(end, start);
    return fabsf(w) < 0.5f ? __fmaf_rn(w, d, start) : __fmaf_rn(__fsub_rn(w, 1.0f), d, end);
}

__device__ __forceinline__ float maximum_torch(float a, float b) {
    return (isnan(a) || isnan(b)) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
}

__device__ __forceinline__ float prep_grad(float g, int flags, const OptimControl* c) {
    if (flags & OPT_UNSCALE) g = __fmul_rn(g, c->inv_scale);
    if (flags & OPT_CLIP) g = __fmul_rn(g, c->clip_coef);
    return g;
}

// The rules, one element each, as kiln-cpu's optim.rs (which says why each rounding).
struct SgdRule {  // A: weight decay, B: momentum, C: Nesterov; s0: momentum buffer
    __device__ static void apply(const float* f, int flags, float g, float& p, float& buf, float&,
                                 float&) {
        if (flags & OPT_RULE_A) g = __fmaf_rn(p, f[0], g);
        if (flags & OPT_RULE_B) {
            buf = f[4] != 0.0f ? g : __fmaf_rn(g, f[2], __fmul_rn(buf, f[1]));
            g = (flags & OPT_RULE_C) ? __fmaf_rn(buf, f[1], g) : buf;
        }
        p = __fmaf_rn(g, f[3], p);
    }
};

struct AdamRule {  // A: weight decay, B: decoupled (AdamW), C: AMSGrad
    __device__ static void apply(const float* f, int flags, float g, float& p, float& m, float& v,
                                 float& vmax) {
        if (flags & OPT_RULE_A) {
            if (flags & OPT_RULE_B) p = __fmul_rn(p, f[6]);
            else g = __fmaf_rn(p, f[6], g);
        }
        m = lerp_torch(m, g, f[0]);
        v = __fmaf_rn(__fmul_rn(f[2], g), g, __fmul_rn(v, f[1]));
        float vv = v;
        if (flags & OPT_RULE_C) {
            vmax = maximum_torch(vmax, v);
            vv = vmax;
        }
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), f[3]), f[4]);
        p = __fadd_rn(p, __fdiv_rn(__fmul_rn(f[5], m), denom));
    }
};

// A: weight decay, B: momentum, C: centered. s0: square_avg, s1: momentum_buffer (B),
// s2: grad_avg (C); the launcher passes the states in those slots.
struct RmsPropRule {
    __device__ static void apply(const float* f, int flags, float g, float& p, float& sq,
                                 float& buf, float& ga) {
        if (flags & OPT_RULE_A) g = __fmaf_rn(p, f[0], g);
        sq = __fmaf_rn(__fmul_rn(f[2], g), g, __fmul_rn(sq, f[1]));
        float avg;
        if (flags & OPT_RULE_C) {
            ga = lerp_torch(ga, g, f[2]);
            avg = __fsqrt_rn(__fmaf_rn(-ga, ga, sq));
        } else {
            avg = __fsqrt_rn(sq);
        }
        avg = __fadd_rn(avg, f[3]);
        if (flags & OPT_RULE_B) {
            buf = __fadd_rn(__fmul_rn(buf, f[4]), __fdiv_rn(g, avg));
            p = __fmaf_rn(buf, f[5], p);
        } else {
            p = __fadd_rn(p, __fdiv_rn(__fmul_rn(f[5], g), avg));
        }
    }
};

struct AdagradRule {  // A: weight decay; s0: sum
    __device__ static void apply(const float* f, int flags, float g, float& p, float& sum, float&,
                                 float&) {
        if (flags & OPT_RULE_A) g = __fmaf_rn(p, f[0], g);
        sum = __fmaf_rn(g, g, sum);
        p = __fadd_rn(p, __fdiv_rn(__fmul_rn(f[2], g), __fadd_rn(__fsqrt_rn(sum), f[1])));
    }
};

__device__ __forceinline__ u16 to_half_bits(float v, int flags) {
    return (flags & OPT_COPY_BF16) ? f32_to_bf16(v) : f32_to_f16(v);
}

// All loads of a thread's four elements are issued before any arithmetic, so that each
// thread keeps up to 64 bytes in flight.
template <class Rule>
__device__ __forceinline__ void update(float* p, const float* g, float* s0, float* s1, float* s2,
                                       u16* copy, u64 n, const OptimControl* c, int flags) {
    follow_previous();
    if (c->skipped) return;
    float f[8];
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = c->factors[i];
    const u64 i0 = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i0 >= n) return;
    float pv[4], gv[4], a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0}, d[4] = {0, 0, 0, 0};
    const bool whole = (flags & OPT_VECTOR) && i0 + 4 <= n;
    if (whole) {
        const float4 p4 = *(const float4*)(p + i0), g4 = *(const float4*)(g + i0);
        pv[0] = p4.x; pv[1] = p4.y; pv[2] = p4.z; pv[3] = p4.w;
        gv[0] = g4.x; gv[1] = g4.y; gv[2] = g4.z; gv[3] = g4.w;
        float* st[3] = {s0, s1, s2};
        float* dst[3] = {a, b, d};
#pragma unroll
        for (int s = 0; s < 3; s++) {
            if (st[s]) {
                const float4 v = *(const float4*)(st[s] + i0);
                dst[s][0] = v.x; dst[s][1] = v.y; dst[s][2] = v.z; dst[s][3] = v.w;
            }
        }
    } else {
        for (int j = 0; j < 4 && i0 + j < n; j++) {
            pv[j] = p[i0 + j];
            gv[j] = g[i0 + j];
            if (s0) a[j] = s0[i0 + j];
            if (s1) b[j] = s1[i0 + j];
            if (s2) d[j] = s2[i0 + j];
        }
    }
#pragma unroll
    for (int j = 0; j < 4; j++) Rule::apply(f, flags, prep_grad(gv[j], flags, c), pv[j], a[j], b[j], d[j]);
    if (whole) {
        *(float4*)(p + i0) = make_float4(pv[0], pv[1], pv[2], pv[3]);
        float* st[3] = {s0, s1, s2};
        const float* src[3] = {a, b, d};
#pragma unroll
        for (int s = 0; s < 3; s++)
            if (st[s]) *(float4*)(st[s] + i0) = make_float4(src[s][0], src[s][1], src[s][2], src[s][3]);
        if (flags & (OPT_COPY_BF16 | OPT_COPY_F16)) {
            uint2 h;
            h.x = (u32)to_half_bits(pv[0], flags) | ((u32)to_half_bits(pv[1], flags) << 16);
            h.y = (u32)to_half_bits(pv[2], flags) | ((u32)to_half_bits(pv[3], flags) << 16);
            *(uint2*)(copy + i0) = h;
        }
    } else {
        for (int j = 0; j < 4 && i0 + j < n; j++) {
            p[i0 + j] = pv[j];
            if (s0) s0[i0 + j] = a[j];
            if (s1) s1[i0 + j] = b[j];
            if (s2) s2[i0 + j] = d[j];
            if (flags & (OPT_COPY_BF16 | OPT_COPY_F16)) copy[i0 + j] = to_half_bits(pv[j], flags);
        }
    }
}

#define OPTIM_KERNEL(name, Rule)                                                              \
    extern "C" __global__ void name(float* p, const float* g, float* s0, float* s1, float* s2, \
                                    u16* copy, u64 n, const OptimControl* c, int flags) {      \
        update<Rule>(p, g, s0, s1, s2, copy, n, c, flags);                                   \
    }

OPTIM_KERNEL(optim_sgd, SgdRule)
OPTIM_KERNEL(optim_adam, AdamRule)
OPTIM_KERNEL(optim_rmsprop, RmsPropRule)
OPTIM_KERNEL(optim_adagrad, AdagradRule)
