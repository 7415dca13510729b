//! One sequence's KV cache: keys and values of every layer in one of the types of
//! [`DType::KV_CACHE`] (F32, F16, BF16, Q8_0), chosen when the cache is made. The cache
//! tensors' type is the whole of it: the backend converts rows as it writes them and
//! decodes them as attention reads them.

use crate::config::ModelConfig;
use crate::model::Model;
use kiln_core::{DType, Error, Result, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};

/// Keys and values of every layer, `[capacity, kv_heads, head_dim]` each, on the device.
pub struct KvCache {
    pub(crate) k: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
    pub(crate) capacity: usize,
    /// Unique to this cache: a recorded decode step writes into this cache's tensors, so
    /// it may be replayed only on this cache.
    pub(crate) id: u64,
}

pub(crate) static NEXT_CACHE_ID: AtomicU64 = AtomicU64::new(0);

impl KvCache {
    /// Positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The type its keys and values are stored in.
    pub fn dtype(&self) -> DType {
        self.k.first().map_or(DType::F32, Tensor::dtype)
    }
}

/// Why `config`'s keys and values cannot be kept as `dtype`, if they cannot: a type that
/// is not one of [`DType::KV_CACHE`], or Q8_0 for heads that are not whole blocks of 32.
pub fn check_kv_type(config: &ModelConfig, dtype: DType) -> Result<()> {
    if !DType::KV_CACHE.contains(&dtype) {
        return Err(Error::unsupported(format!(
            "a KV cache of {dtype}: the KV cache types are f32, f16, bf16 and q8_0"
        )));
    }
    let block = dtype.block_size();
    if !config.head_dim.is_multiple_of(block) {
        return Err(Error::unsupported(format!(
            "a {dtype} KV cache keeps heads in blocks of {block}, and this model's heads have {} dimensions: use f16, bf16 or f32",
            config.head_dim
        )));
    }
    Ok(())
}

/// Keys and values of every layer for `rows` positions, `[rows, kv_heads, head_dim]` of
/// `dtype` each, checked against free memory before anything is allocated (a failed host
/// allocation aborts the process). `what` names the cache in the error.
pub(crate) fn layer_tensors(
    model: &Model,
    rows: usize,
    dtype: DType,
    what: &str,
) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let c = &model.config;
    check_kv_type(c, dtype)?;
    let b = model.backend().as_ref();
    let need = crate::memory::kv_cache_bytes(c, rows, dtype);
    if let Some(free) = crate::memory::free_memory(b)? {
        if need > free.bytes {
            return Err(Error::Device(format!(
                "{what} needs {} as {dtype}; {} is free in {}",
                crate::memory::human_bytes(need),
                crate::memory::human_bytes(free.bytes),
                free.what
            )));
        }
    }
    let shape = Shape::new(vec![rows, c.n_kv_heads, c.head_dim])?;
    let mut k = Vec::with_capacity(c.n_layers);
    let mut v = Vec::with_capacity(c.n_layers);
    for _ in 0..c.n_layers {
        k.push(b.zeros(dtype, shape.clone())?);
        v.push(b.zeros(dtype, shape.clone())?);
    }
    Ok((k, v))
}

fn check_positions(capacity: usize) -> Result<()> {
    if i32::try_from(capacity).is_err() {
        return Err(Error::shape(format!(
            "a context of {capacity} positions (positions are i32 on the device)"
        )));
    }
    Ok(())
}

impl Model {
    /// A KV cache for `capacity` positions, its keys and values kept as `dtype` (one of
    /// [`DType::KV_CACHE`]; see [`check_kv_type`]).
    pub fn new_cache(&self, capacity: usize, dtype: DType) -> Result<KvCache> {
        check_positions(capacity)?;
        let what = format!("a KV cache of {capacity} positions");
        let (k, v) = layer_tensors(self, capacity, dtype, &what)?;
        Ok(KvCache {
            k,
            v,
            capacity,
            id: NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Make `cache` hold `capacity` positions, keeping the rows it has and its type: a
    /// caller can hand a sequence's cache more room as it grows instead of a whole context
    /// up front. The rows are copied on the device, and the cache gets a new identity,
    /// since a recorded step refers to the old tensors. Not checked against free memory:
    /// the caller sizes its memory once, at start.
    pub fn grow_cache(&self, cache: &mut KvCache, capacity: usize) -> Result<()> {
        if capacity <= cache.capacity {
            return Ok(());
        }
        check_positions(capacity)?;
        let c = &self.config;
        let b = self.backend().as_ref();
        let kept = cache.capacity;
        let mut rows = b.zeros(DType::I32, Shape::new(vec![kept])?)?;
        let ids: Vec<u8> = (0..kept as i32).flat_map(i32::to_le_bytes).collect();
        b.write(&mut rows, &ids)?;
        let shape = Shape::new(vec![capacity, c.n_kv_heads, c.head_dim])?;
        for t in cache.k.iter_mut().chain(cache.v.iter_mut()) {
            let mut grown = b.zeros(t.dtype(), shape.clone())?;
            b.write_rows(t, &mut grown, &rows)?;
            *t = grown;
        }
        cache.capacity = capacity;
        cache.id = NEXT_CACHE_ID.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
