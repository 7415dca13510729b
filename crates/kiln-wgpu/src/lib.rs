//! kiln's portable GPU backend: Vulkan, Metal and DX12 through wgpu.
//!
//! Weights stay on the device in their stored format (quantized ones split into quants and
//! scales, `kiln_core::quant::gpu_layout`, so that WGSL reads them as words); every op is
//! a WGSL compute shader from `src/shaders/`. Ops are recorded into command encoders,
//! submitted every few dozen dispatches and when something is read back (`stream`), so
//! the GPU runs a step while the rest of it is recorded; only the sampled id comes back. Reductions use subgroups where the adapter has them and
//! workgroup memory otherwise (`KILN_WGPU_NO_SUBGROUPS=1` forces the latter); F16 weights
//! meet x in f16 arithmetic where the adapter has `SHADER_F16` (`KILN_WGPU_NO_F16=1`: f32).

mod attention;
mod device;
mod elementwise;
mod kernels;
mod kv_cache;
mod matmul;
mod memory;
mod norm;
mod optim;
mod pipeline_cache;
mod profile;
mod rounded_row;
mod sample;
mod stream;

pub use device::{adapter_for_tests, adapters, AdapterSummary, Options};
pub use memory::WgpuStorage;

use device::Caps;
use kernels::{KernelSpec, Kernels};
use kiln_core::{
    quant::gpu_layout, AttentionParams, Backend, DType, Device, Error, HostBytes, KernelTime,
    Pages, Result, RmsNorm, RopeLayout, SampleParams, Shape, Tensor,
};
use matmul::{Epilogue, NormFirst};
use std::sync::Arc;
use stream::{Binding, Stream};

pub struct WgpuBackend {
    index: usize,
    summary: AdapterSummary,
    caps: Caps,
    kernels: Kernels,
    stream: Stream,
    /// The penalized ids of the last draw, kept and grown.
    penalized: std::sync::Mutex<Option<WgpuStorage>>,
    /// The records of the last draws, kept and grown.
    draw_records: std::sync::Mutex<Option<WgpuStorage>>,
    /// A batch's ids drawn (`sample_rows`), kept and grown.
    drawn: std::sync::Mutex<Option<Tensor>>,
    /// Decode's row of x rounded for the products (`rounded_row`), kept and grown.
    rounded_row: std::sync::Mutex<Option<WgpuStorage>>,
    /// The optimizer's control block as the last step left it on the device (`optim`):
    /// the storage id it lives in, and its value. A write to that tensor drops it.
    optim_control: std::sync::Mutex<Option<(u64, kiln_core::optim::StepControl)>>,
    _adapter: wgpu::Adapter,
}

impl WgpuBackend {
    /// Adapter `index` of [`adapters`], with the options the environment gives.
    pub fn new(index: usize) -> Result<Self> {
        Self::with_options(index, Options::from_env())
    }

    pub fn with_options(index: usize, options: Options) -> Result<Self> {
        let opened = device::open(index, options)?;
        let info = opened.adapter.get_info();
        let mut sources = kernels::all_sources();
        sources.push(&info.driver);
        sources.push(&info.driver_info);
        let cache = pipeline_cache::open(
            &opened.device,
            &info,
            opened.device.features(),
            pipeline_cache::source_hash(&sources),
        );
        let kernels = Kernels::new(&opened.device, opened.caps, cache);
        let stream = Stream::new(
            opened.device,
            opened.queue,
            kernels.params_layout(),
            opened.caps.uniform_align,
            opened.caps.timestamps,
        );
        Ok(WgpuBackend {
            index,
            summary: opened.summary,
            caps: opened.caps,
            kernels,
            stream,
            penalized: Default::default(),
            draw_records: Default::default(),
            drawn: Default::default(),
            rounded_row: Default::default(),
            optim_control: Default::default(),
            _adapter: opened.adapter,
        })
    }

    pub fn summary(&self) -> &AdapterSummary {
        &self.summary
    }

    /// Whether the reductions run on subgroups (false: workgroup memory).
    pub fn uses_subgroups(&self) -> bool {
        self.caps.subgroups
    }

    /// Whether the kernels with an f16 form use it (false: f32 arithmetic).
    pub fn uses_f16(&self) -> bool {
        self.caps.f16
    }

    /// Whether prompts' products with `dtype` weights of rows of `k` run on cooperative
    /// matrices (tensor cores) in f16 on this device (`matmul::tensor_cores_take`).
    pub fn tensor_cores_take(&self, dtype: kiln_core::DType, k: usize) -> bool {
        matmul::tensor_cores_take(self, dtype, k)
    }

    fn kernel(&self, spec: &KernelSpec, constants: &[(&str, f64)]) -> Result<Arc<kernels::Kernel>> {
        self.kernels.get(self.stream.device(), spec, constants)
    }

    /// `groups` workgroups as a grid within the per-dimension limit, and its width (the
    /// shaders' `groups_x`).
    fn grid(&self, groups: usize) -> Result<((u32, u32, u32), u32)> {
        let max = self.caps.max_groups.max(1) as usize;
        let x = groups.clamp(1, max);
        let y = groups.div_ceil(x);
        if y > max {
            return Err(Error::Device(format!(
                "wgpu: {groups} workgroups are more than this adapter can launch"
            )));
        }
        Ok(((x as u32, y as u32, 1), x as u32))
    }

    /// Rows a matrix-vector workgroup of 256 lanes takes: a row slot each, a subgroup (of
    /// the largest size the adapter may pick) or 32 lanes on the portable reductions.
    fn matvec_row_slots(&self) -> usize {
        if self.caps.subgroups {
            (256 / self.caps.subgroup_max).max(1) as usize
        } else {
            8
        }
    }

    fn alloc(&self, bytes: usize) -> Result<WgpuStorage> {
        memory::alloc(
            &self.stream,
            self.index,
            &self.summary.name,
            bytes as u64,
            self.caps.max_buffer,
        )
    }
}

impl Drop for WgpuBackend {
    fn drop(&mut self) {
        self.kernels.save_cache();
    }
}

/// The backend's own storage of `t`, or an error naming `what` when it lives elsewhere.
pub(crate) fn storage<'a>(t: &'a Tensor, what: &str) -> Result<&'a WgpuStorage> {
    t.storage()
        .as_any()
        .downcast_ref::<WgpuStorage>()
        .ok_or_else(|| Error::Device(format!("{what} is on {}, not on a wgpu device", t.device())))
}

pub(crate) fn f32_tensor<'a>(t: &'a Tensor, what: &str) -> Result<Binding<'a>> {
    if t.dtype() != DType::F32 {
        return Err(Error::shape(format!(
            "{what} must be F32, got {}",
            t.dtype()
        )));
    }
    Ok(storage(t, what)?.binding())
}

pub(crate) fn i32_tensor<'a>(t: &'a Tensor, len: usize, what: &str) -> Result<Binding<'a>> {
    if t.dtype() != DType::I32 || t.shape().numel() < len {
        return Err(Error::shape(format!(
            "{what} must be I32 with at least {len} values, got {} {}",
            t.dtype(),
            t.shape()
        )));
    }
    Ok(storage(t, what)?.binding())
}

/// The bytes of `shape` elements of `dtype`, or an error if rows are not whole blocks.
fn data_bytes(dtype: DType, shape: &Shape) -> Result<usize> {
    dtype
        .row_bytes(shape.row_len())?
        .checked_mul(shape.rows())
        .ok_or_else(|| Error::shape(format!("{shape} of {dtype} does not fit in memory")))
}

impl Backend for WgpuBackend {
    fn device(&self) -> Device {
        Device::Wgpu(self.index)
    }

    fn describe(&self) -> String {
        let s = &self.summary;
        format!(
            "wgpu:{} {} ({}, {})",
            self.index,
            s.name,
            s.backend,
            if self.caps.subgroups {
                format!("subgroups {}-{}", s.subgroup_sizes.0, s.subgroup_sizes.1)
            } else {
                "workgroup reductions".to_string()
            }
        )
    }

    fn zeros(&self, dtype: DType, shape: Shape) -> Result<Tensor> {
        // wgpu zero-fills new buffers.
        let bytes = data_bytes(dtype, &shape)?;
        Ok(Tensor::from_storage(
            Box::new(self.alloc(bytes)?),
            dtype,
            shape,
        ))
    }

    fn upload(&self, dtype: DType, shape: Shape, data: HostBytes) -> Result<Tensor> {
        let bytes = data_bytes(dtype, &shape)?;
        if data.len() != bytes {
            return Err(Error::shape(format!(
                "{shape} of {dtype} is {bytes} bytes, got {}",
                data.len()
            )));
        }
        let s = self.alloc(bytes)?;
        match gpu_layout::split(dtype, data.as_slice()) {
            Some(split) => memory::write(&self.stream, &s, &split)?,
            None => memory::write(&self.stream, &s, data.as_slice())?,
        }
        Ok(Tensor::from_storage(Box::new(s), dtype, shape))
    }

    fn download(&self, t: &Tensor) -> Result<Vec<u8>> {
        let s = storage(t, "the tensor to read")?;
        let out = memory::read(&self.stream, s, s.bytes)?;
        Ok(gpu_layout::join(t.dtype(), &out).unwrap_or(out))
    }

    fn write(&self, t: &mut Tensor, data: &[u8]) -> Result<()> {
        let s = storage(t, "the tensor to write")?;
        if data.len() as u64 != s.bytes {
            return Err(Error::shape(format!(
                "writing {} bytes into {} of {} ({} bytes)",
                data.len(),
                t.shape(),
                t.dtype(),
                s.bytes
            )));
        }
        self.forget_optim_control(s.id);
        match gpu_layout::split(t.dtype(), data) {
            Some(split) => memory::write(&self.stream, s, &split),
            None => memory::write(&self.stream, s, data),
        }
    }

    fn fill(&self, t: &mut Tensor, value: f32) -> Result<()> {
        self.forget_optim_control(storage(t, "the tensor to fill")?.id);
        elementwise::fill(self, t, value)
    }

    fn matmul(&self, x: &Tensor, w: &Tensor, out: &mut Tensor) -> Result<()> {
        matmul::matmul(self, x, w, out, Epilogue::Store, None)
    }

    fn matmul_add(
        &self,
        x: &Tensor,
        w: &Tensor,
        acc: &mut Tensor,
        _tmp: &mut Tensor,
    ) -> Result<()> {
        matmul::matmul(self, x, w, acc, Epilogue::Add, None)
    }

    fn matmul_many(&self, x: &Tensor, ws: &[&Tensor], outs: &mut [&mut Tensor]) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(Error::shape("matmul_many: as many outputs as weights"));
        }
        if let Some(form) = rounded_row::shared_form(self, x, ws)? {
            let row = rounded_row::round_row(self, x, None, form)?;
            return rounded_row::matvec_many(self, &row, ws, outs);
        }
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(x, w, out)?;
        }
        Ok(())
    }

    fn rms_norm_matmul_many(
        &self,
        norm: &RmsNorm,
        normed: &mut Tensor,
        ws: &[&Tensor],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        if ws.len() != outs.len() {
            return Err(Error::shape(
                "rms_norm_matmul_many: as many outputs as weights",
            ));
        }
        if !matmul::fusable(norm.x) {
            self.rms_norm(norm.x, norm.weight, norm.eps, normed)?;
            return self.matmul_many(normed, ws, outs);
        }
        let with_normed = NormFirst {
            weight: norm.weight,
            eps: norm.eps,
            normed: Some(&*normed),
        };
        if let Some(form) = rounded_row::shared_form(self, norm.x, ws)? {
            // One rounding of the normed row for every product.
            let row = rounded_row::round_row(self, norm.x, Some(&with_normed), form)?;
            return rounded_row::matvec_many(self, &row, ws, outs);
        }
        // Each product normalises its own copy of the row; the first also writes it.
        for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            let first = NormFirst {
                weight: norm.weight,
                eps: norm.eps,
                normed: (i == 0).then_some(&*normed),
            };
            matmul::matmul(self, norm.x, w, out, Epilogue::Store, Some(&first))?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_gated_ffn(
        &self,
        norm: &RmsNorm,
        normed: &mut Tensor,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
        tmp_gate: &mut Tensor,
        tmp_up: &mut Tensor,
    ) -> Result<()> {
        if !matmul::fusable(norm.x) {
            self.rms_norm(norm.x, norm.weight, norm.eps, normed)?;
            return self.gated_ffn(normed, gate, up, gelu, out, tmp_gate, tmp_up);
        }
        let with_normed = NormFirst {
            weight: norm.weight,
            eps: norm.eps,
            normed: Some(&*normed),
        };
        if let Some(form) = rounded_row::shared_form(self, norm.x, &[gate, up])? {
            let row = rounded_row::round_row(self, norm.x, Some(&with_normed), form)?;
            return rounded_row::matvec_gated(self, &row, gate, up, gelu, out, tmp_gate);
        }
        matmul::matmul(
            self,
            norm.x,
            gate,
            tmp_gate,
            Epilogue::Store,
            Some(&with_normed),
        )?;
        let norm_only = NormFirst {
            normed: None,
            ..with_normed
        };
        let epilogue = Epilogue::Gated {
            gate: tmp_gate,
            gelu,
        };
        matmul::matmul(self, norm.x, up, out, epilogue, Some(&norm_only))
    }

    #[allow(clippy::too_many_arguments)]
    fn gated_ffn(
        &self,
        x: &Tensor,
        gate: &Tensor,
        up: &Tensor,
        gelu: bool,
        out: &mut Tensor,
        tmp_gate: &mut Tensor,
        tmp_up: &mut Tensor,
    ) -> Result<()> {
        self.matmul(x, gate, tmp_gate)?;
        if matmul::fusable(x) {
            let epilogue = Epilogue::Gated {
                gate: tmp_gate,
                gelu,
            };
            return matmul::matmul(self, x, up, out, epilogue, None);
        }
        self.matmul(x, up, tmp_up)?;
        if gelu {
            self.gelu_mul(tmp_gate, tmp_up, out)
        } else {
            self.silu_mul(tmp_gate, tmp_up, out)
        }
    }

    fn rope_write_kv(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        pos: &Tensor,
        rows: Option<&Tensor>,
        rope: Option<(&Tensor, RopeLayout)>,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
    ) -> Result<()> {
        match rows {
            // A paged pool's slots: the fused shader writes at the positions.
            Some(_) => {
                kiln_core::rope_write_kv_by_ops(self, q, k, v, pos, rows, rope, k_cache, v_cache)
            }
            None => attention::rope_write_kv(self, q, k, v, pos, rope, k_cache, v_cache),
        }
    }

    fn embedding(&self, table: &Tensor, ids: &Tensor, out: &mut Tensor) -> Result<()> {
        matmul::embedding(self, table, ids, out)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        norm::rms_norm(self, x, weight, eps, out)
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        norm::layer_norm(self, x, weight, bias, eps, out)
    }

    fn softmax(&self, x: &mut Tensor) -> Result<()> {
        norm::softmax(self, x)
    }

    fn rope(
        &self,
        x: &mut Tensor,
        pos: &Tensor,
        inv_freq: &Tensor,
        layout: RopeLayout,
    ) -> Result<()> {
        attention::rope(self, x, pos, inv_freq, layout)
    }

    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        elementwise::binary(self, acc, x, 0, "add_assign")
    }

    fn mul_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()> {
        elementwise::binary(self, acc, x, 1, "mul_assign")
    }

    fn scale(&self, x: &mut Tensor, s: f32) -> Result<()> {
        elementwise::unary(self, x, 0, s)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        elementwise::gated(self, gate, up, out, 0)
    }

    fn gelu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        elementwise::gated(self, gate, up, out, 1)
    }

    fn gelu(&self, x: &mut Tensor) -> Result<()> {
        elementwise::unary(self, x, 1, 0.0)
    }

    fn softcap(&self, x: &mut Tensor, cap: f32) -> Result<()> {
        if !(cap > 0.0 && cap.is_finite()) {
            return Err(Error::shape(format!("softcap must be positive, got {cap}")));
        }
        elementwise::unary(self, x, 2, cap)
    }

    fn write_rows(&self, src: &Tensor, dst: &mut Tensor, pos: &Tensor) -> Result<()> {
        kv_cache::write_rows(self, src, dst, pos)
    }

    fn slice_cols(&self, src: &Tensor, col0: usize, dst: &mut Tensor) -> Result<()> {
        elementwise::slice_cols(self, src, col0, dst)
    }

    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        attention::attention(self, q, k_cache, v_cache, pos, params, out)
    }

    fn paged_attention(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
        pos: &Tensor,
        pages: &Pages,
        params: &AttentionParams,
        out: &mut Tensor,
    ) -> Result<()> {
        attention::paged_attention(self, q, k_pool, v_pool, pos, pages, params, out)
    }

    fn argmax(&self, x: &Tensor, out: &mut Tensor) -> Result<()> {
        norm::argmax(self, x, out)
    }

    fn sample(
        &self,
        logits: &mut Tensor,
        penalized: &[u32],
        params: &SampleParams,
        out: &mut Tensor,
    ) -> Result<()> {
        sample::sample(self, logits, penalized, params, out)
    }

    fn sample_rows(
        &self,
        logits: &mut Tensor,
        draws: &[kiln_core::RowDraw<'_>],
    ) -> Result<Vec<u32>> {
        sample::sample_rows(self, logits, draws)
    }

    fn optim(&self) -> Option<&dyn kiln_core::OptimKernels> {
        Some(self)
    }

    fn kernel_profile(&self) -> Option<Vec<KernelTime>> {
        self.stream.profile().map(|rows| {
            rows.into_iter()
                .map(|(name, calls, total_ms)| KernelTime {
                    name,
                    calls,
                    total_ms,
                })
                .collect()
        })
    }
}
