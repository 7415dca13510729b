//! What a model will take in memory for a given context, worked out from its
//! configuration before anything is allocated, and what memory the machine has free: so
//! that a context too large is refused with numbers a user can act on, instead of failing
//! in the middle of an allocation (or aborting the process on the host).

use crate::config::ModelConfig;
use kiln_core::{Backend, DType, Device, Result};
use std::fmt;

/// Room kept free beside the planned buffers: backend workspaces (cuBLAS), per-op
/// temporaries, the allocator's own overhead.
const DEVICE_MARGIN: u128 = 256 << 20;
const HOST_MARGIN: u128 = 64 << 20;

/// Memory a model needs: a part fixed by the model and batch, and a part per position of
/// context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// Weights held in the device's own memory (none on the CPU, which computes from the
    /// file's mapping).
    pub weights: u128,
    /// Activation buffers that do not grow with the context, plus a working margin.
    pub buffers: u128,
    /// The type keys and values are kept in.
    pub kv: DType,
    /// KV cache bytes per position, in that type.
    pub kv_per_position: u128,
    /// Other bytes per position: activations when a batch spans the whole context.
    pub other_per_position: u128,
}

/// Free memory and what it is (for messages).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeMemory {
    pub bytes: u128,
    /// "GPU memory (cuda:0)", "host memory (MemAvailable)", "address space (ulimit -v)".
    pub what: String,
}

/// A context that does not fit, with the numbers that say what to change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoRoom {
    pub context: usize,
    pub kv: DType,
    pub kv_bytes: u128,
    /// Free after the weights and fixed buffers (0 when even they do not fit).
    pub free_after_weights: u128,
    /// Weights and fixed buffers.
    pub fixed: u128,
    pub free: FreeMemory,
    /// The largest context that fits; 0 when none does.
    pub largest: usize,
}

/// A number of bytes for people: GiB above 1 GiB, else MiB.
pub fn human_bytes(b: u128) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    const KIB: f64 = 1024.0;
    // Small amounts keep a unit that shows them: "0.0 MiB" of a 4096-byte setting says
    // nothing to the user who typed it.
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / GIB)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / MIB)
    } else if b >= 1 << 10 {
        format!("{:.1} KiB", b as f64 / KIB)
    } else {
        format!("{b} bytes")
    }
}

impl fmt::Display for NoRoom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let free = human_bytes(self.free.bytes);
        if self.largest == 0 {
            return write!(
                f,
                "the model does not fit in {}: its weights and buffers need {} before any context, and {free} is free",
                self.free.what,
                human_bytes(self.fixed),
            );
        }
        write!(
            f,
            "a context of {} tokens does not fit in {}: its KV cache needs {} as {}, and {} is free after the weights and buffers ({} of {free}); the largest context that fits is {}",
            self.context,
            self.free.what,
            human_bytes(self.kv_bytes),
            self.kv,
            human_bytes(self.free_after_weights),
            human_bytes(self.fixed),
            self.largest
        )
    }
}

/// Bytes of a KV cache of `context` positions whose keys and values are kept as `kv`.
pub fn kv_cache_bytes(config: &ModelConfig, context: usize, kv: DType) -> u128 {
    kv_per_position(config, kv).saturating_mul(context as u128)
}

/// Keys and values of every layer at one position: each head a row of `head_dim` values
/// in `kv`'s encoding (for block types, `head_dim / block` blocks; a head that is not
/// whole blocks is refused when the cache is made, and counted here as if rounded up).
fn kv_per_position(c: &ModelConfig, kv: DType) -> u128 {
    let head =
        (c.head_dim.div_ceil(kv.block_size()) as u128).saturating_mul(kv.block_bytes() as u128);
    (c.n_layers as u128)
        .saturating_mul(2)
        .saturating_mul((c.n_kv_heads as u128).saturating_mul(head))
}

impl MemoryPlan {
    /// The plan for `config` on `device`, whose weights take `weight_bytes` as stored,
    /// running batches of up to `batch` tokens, keys and values kept as `kv`; `all_logits`
    /// when a batch returns the logits of every position and the batch is the whole
    /// context (perplexity).
    pub fn new(
        config: &ModelConfig,
        weight_bytes: u64,
        device: Device,
        batch: usize,
        all_logits: bool,
        kv: DType,
    ) -> MemoryPlan {
        let c = config;
        let u = |v: usize| v as u128;
        let kv_dim = u(c.n_kv_heads).saturating_mul(u(c.head_dim));
        let q_dim = u(c.n_heads).saturating_mul(u(c.head_dim));
        let kv_per_position = kv_per_position(c, kv);
        // f32 buffers of one token in a batch (an upper bound: fused and split layouts'
        // buffers both counted), see `Scratch` in model.rs.
        let per_token = (5 * u(c.dim))
            .saturating_add(q_dim.saturating_mul(3))
            .saturating_add(kv_dim.saturating_mul(4))
            .saturating_add(5 * u(c.ffn_dim))
            .saturating_mul(4)
            .saturating_add(8);
        // Logits of every position live on the device, come back as bytes, and become
        // f32 values: three copies.
        let logits_per_token = u(c.vocab_size).saturating_mul(3 * 4);
        let one_token = per_token.saturating_add(u(c.vocab_size).saturating_mul(4));
        let (margin, weights) = match device {
            Device::Cpu => (HOST_MARGIN, 0),
            Device::Cuda(_) | Device::Wgpu(_) => (DEVICE_MARGIN, u128::from(weight_bytes)),
        };
        let (buffers, other_per_position) = if all_logits {
            (
                one_token.saturating_add(margin),
                per_token.saturating_add(logits_per_token),
            )
        } else {
            // A decode step's buffers and a prefill's, both kept.
            let prefill = per_token.saturating_mul(u(batch));
            (
                one_token
                    .saturating_mul(2)
                    .saturating_add(prefill)
                    .saturating_add(margin),
                0,
            )
        };
        MemoryPlan {
            weights,
            buffers,
            kv,
            kv_per_position,
            other_per_position,
        }
    }

    fn per_position(&self) -> u128 {
        self.kv_per_position
            .saturating_add(self.other_per_position)
            .max(1)
    }

    /// Bytes needed for `context` positions, weights included.
    pub fn total(&self, context: usize) -> u128 {
        self.weights
            .saturating_add(self.buffers)
            .saturating_add(self.per_position().saturating_mul(context as u128))
    }

    /// Refuse a context whose buffers do not fit in `free` (boxed: the numbers are many).
    pub fn check(&self, context: usize, free: &FreeMemory) -> Result<(), Box<NoRoom>> {
        if self.total(context) <= free.bytes {
            return Ok(());
        }
        let fixed = self.weights.saturating_add(self.buffers);
        let after = free.bytes.saturating_sub(fixed);
        let largest = (after / self.per_position()).min(i32::MAX as u128) as usize;
        Err(Box::new(NoRoom {
            context,
            kv: self.kv,
            kv_bytes: self.kv_per_position.saturating_mul(context as u128),
            free_after_weights: after,
            fixed,
            free: free.clone(),
            largest,
        }))
    }
}

/// Memory free for the model on `backend`'s device: what the device reports, or on the
/// host the smaller of the kernel's estimate of available memory and the room left under
/// the process's address-space limit. `None` when neither can be read.
pub fn free_memory(backend: &dyn Backend) -> Result<Option<FreeMemory>> {
    if let Some(bytes) = backend.free_memory()? {
        return Ok(Some(FreeMemory {
            bytes: bytes as u128,
            what: format!("GPU memory ({})", backend.device()),
        }));
    }
    Ok(host_free_memory())
}

/// Host memory free for kiln: the smaller of the kernel's estimate of available memory
/// (MemAvailable) and the room left under the process's address-space limit.
pub fn host_free_memory() -> Option<FreeMemory> {
    let kib_field = |text: &str, key: &str| -> Option<u128> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        let kib: u128 = line[key.len()..].split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    };
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| kib_field(&t, "MemAvailable:"))
        .map(|bytes| FreeMemory {
            bytes,
            what: "host memory (MemAvailable)".into(),
        });
    let address_space = address_space_limit().and_then(|limit| {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let used = kib_field(&status, "VmSize:")?;
        Some(FreeMemory {
            bytes: limit.saturating_sub(used),
            what: "the address space left under the process's limit (ulimit -v)".into(),
        })
    });
    match (available, address_space) {
        (Some(a), Some(b)) => Some(if b.bytes < a.bytes { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// RLIMIT_AS's soft limit in bytes, from /proc/self/limits; `None` when unlimited.
fn address_space_limit() -> Option<u128> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    line["Max address space".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::SyntheticShape;

    #[test]
    fn amounts_keep_a_unit_that_shows_them() {
        assert_eq!(human_bytes(0), "0 bytes");
        assert_eq!(human_bytes(1000), "1000 bytes");
        assert_eq!(human_bytes(4096), "4.0 KiB");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
        assert_eq!(human_bytes(5 << 29), "2.50 GiB");
    }

    fn free(bytes: u128) -> FreeMemory {
        FreeMemory {
            bytes,
            what: "test memory".into(),
        }
    }

    #[test]
    fn kv_cache_bytes_follow_the_shape_and_type() {
        let c = SyntheticShape::TinyLlama.config();
        // 22 layers, K and V, 4 KV heads of 64: 4, 2, 2 bytes a value, 34 bytes per 32.
        for (kv, head) in [
            (DType::F32, 64 * 4),
            (DType::F16, 64 * 2),
            (DType::BF16, 64 * 2),
            (DType::Q8_0, 2 * 34),
        ] {
            assert_eq!(kv_cache_bytes(&c, 3, kv), 3 * 22 * 2 * 4 * head, "{kv}");
            let plan = MemoryPlan::new(&c, 1 << 30, Device::Cuda(0), 16, false, kv);
            assert_eq!(plan.kv_per_position, 22 * 2 * 4 * head, "{kv}");
        }
        // An f16 cache holds twice the context of an f32 one in the same memory.
        let avail = free(2 << 30);
        let largest = |kv| {
            let plan = MemoryPlan::new(&c, 1 << 30, Device::Cuda(0), 16, false, kv);
            plan.check(10_000_000, &avail).unwrap_err().largest
        };
        let (f32_ctx, f16_ctx) = (largest(DType::F32), largest(DType::F16));
        assert!(
            f16_ctx >= 2 * f32_ctx && f16_ctx <= 2 * f32_ctx + 1,
            "{f32_ctx} {f16_ctx}"
        );
    }

    #[test]
    fn kv_cache_bytes_follow_the_shape_and_the_largest_context_fits() {
        let c = SyntheticShape::TinyLlama.config();
        let plan = MemoryPlan::new(&c, 1 << 30, Device::Cuda(0), 16, false, DType::F32);
        // 22 layers, K and V, 4 KV heads of 64, f32.
        assert_eq!(plan.kv_per_position, 22 * 2 * 4 * 64 * 4);
        assert_eq!(plan.weights, 1 << 30);
        let avail = free(4 << 30);
        let err = plan.check(2_000_000, &avail).unwrap_err();
        assert_eq!(err.kv_bytes, 2_000_000 * 22 * 2 * 256 * 4);
        assert!(err.largest > 0);
        assert!(plan.check(err.largest, &avail).is_ok());
        assert!(plan.check(err.largest + 1, &avail).is_err());
        let msg = err.to_string();
        assert!(msg.contains("a context of 2000000 tokens"), "{msg}");
        assert!(msg.contains("KV cache needs 83.92 GiB as f32"), "{msg}");
        assert!(msg.contains(&format!("largest context that fits is {}", err.largest)));
        assert!(!msg.contains('\n'));
    }

    #[test]
    fn weights_that_do_not_fit_are_named_and_host_weights_are_mapped() {
        let c = SyntheticShape::TinyLlama.config();
        let gpu = MemoryPlan::new(&c, 8 << 30, Device::Cuda(0), 1, false, DType::F16);
        let err = gpu.check(512, &free(4 << 30)).unwrap_err();
        assert_eq!(err.largest, 0);
        assert!(err.to_string().contains("does not fit"), "{err}");
        let cpu = MemoryPlan::new(&c, 8 << 30, Device::Cpu, 1, false, DType::F32);
        assert_eq!(cpu.weights, 0);
        assert!(cpu.check(512, &free(4 << 30)).is_ok());
    }

    #[test]
    fn hostile_sizes_saturate_instead_of_wrapping() {
        let mut c = SyntheticShape::TinyLlama.config();
        c.head_dim = usize::MAX / 2;
        c.vocab_size = usize::MAX;
        let plan = MemoryPlan::new(&c, u64::MAX, Device::Cuda(0), usize::MAX, true, DType::F32);
        assert!(plan.check(usize::MAX, &free(1 << 40)).is_err());
    }

    #[test]
    fn a_kv_cache_beyond_memory_is_an_error_not_an_abort() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/tiny-llama.gguf"
        );
        let file = kiln_io::gguf::GgufFile::open(path).unwrap();
        let cpu = std::sync::Arc::new(kiln_cpu::CpuBackend::new(Some(1)).unwrap());
        let model = crate::Model::from_gguf(&file, cpu, None).unwrap();
        // 2 layers, K and V, 2 KV heads of 64, f32: 2 KiB a position, 4 TiB in all.
        let err = model
            .new_cache(i32::MAX as usize, DType::F32)
            .err()
            .expect("refused");
        assert!(
            err.to_string()
                .contains("KV cache of 2147483647 positions needs 4096.00 GiB as f32"),
            "{err}"
        );
        // As f16, half of it.
        let err = model
            .new_cache(i32::MAX as usize, DType::F16)
            .err()
            .expect("refused");
        assert!(
            err.to_string().contains("needs 2048.00 GiB as f16"),
            "{err}"
        );
        assert!(model.new_cache(64, DType::Q8_0).is_ok());
        let err = model.new_cache(64, DType::Q4_0).err().expect("refused");
        assert!(err.to_string().contains("f32, f16, bf16 and q8_0"), "{err}");
    }

    #[test]
    fn the_host_reports_some_free_memory() {
        let f = host_free_memory().expect("Linux has /proc/meminfo");
        assert!(f.bytes > 0);
    }
}
