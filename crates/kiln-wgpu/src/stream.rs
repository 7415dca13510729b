//! Recording ops into command encoders and submitting them: nothing waits for the GPU
//! until something is read back.
//!
//! Each dispatch's parameters go into one uniform arena at its own 256-byte slot (bound
//! with a dynamic offset), written once per submission; bind groups of storage buffers
//! are made once per (kernel, buffers) and kept, since a model reuses the same buffers
//! every step.
//!
//! Recording costs the CPU about as much as a small dispatch costs the GPU (wgpu tracks
//! every dispatch's buffers): a step is submitted in pieces, so that the GPU runs the first
//! while the rest are recorded. After a wait the GPU is idle: the first piece is small
//! (`FIRST_PIECE`), and each next one twice the last, up to `SUBMIT_EVERY`. The arena's slots are
//! taken in a ring across submissions, so a piece never rewrites the parameters of one
//! the GPU may still be reading.

use crate::kernels::Kernel;
use crate::profile::Profiler;
use kiln_core::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Bytes of one dispatch's parameters: 16 words.
pub(crate) const PARAMS_BYTES: u64 = 64;
/// Slots of the parameter arena (a ring).
const PARAMS_SLOTS: u64 = 4096;
/// Dispatches recorded before they are submitted, at most (16-96 measured on an H100:
/// 32-48 best, BENCHMARKS.md).
const SUBMIT_EVERY: u64 = 48;
/// The first piece after the GPU went idle.
const FIRST_PIECE: u64 = 8;

/// A range of a storage buffer bound to a kernel.
#[derive(Clone, Copy)]
pub(crate) struct Binding<'a> {
    pub buffer: &'a wgpu::Buffer,
    /// The buffer's kiln id (see `WgpuStorage`), so that cached bind groups can be found
    /// and dropped with it.
    pub id: u64,
    pub offset: u64,
    pub size: u64,
}

type BindKey = (String, Vec<(u64, u64, u64)>);

struct Recording {
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    /// The parameters of the slots from `first_slot` on, written at submission.
    params: Vec<u8>,
    first_slot: u64,
    /// Dispatches recorded since the last submission.
    dispatches: u64,
    /// Dispatches at which this piece is submitted.
    piece: u64,
}

pub(crate) struct Stream {
    device: wgpu::Device,
    queue: wgpu::Queue,
    slot: u64,
    params_buffer: wgpu::Buffer,
    params_group: wgpu::BindGroup,
    rec: Mutex<Recording>,
    bind_groups: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    /// Ids of buffers dropped since the last submission: their bind groups go then.
    dropped: Arc<Mutex<Vec<u64>>>,
    /// Errors wgpu reported outside an error scope (validation, out of memory, a lost
    /// device): the next submission or read returns them.
    errors: Arc<Mutex<Vec<String>>>,
    profiler: Option<Mutex<Profiler>>,
}

impl Stream {
    pub fn new(
        device: wgpu::Device,
        queue: wgpu::Queue,
        params_layout: &wgpu::BindGroupLayout,
        uniform_align: u64,
        timestamps: bool,
    ) -> Self {
        let slot = PARAMS_BYTES.max(uniform_align);
        let params_buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kiln params"),
            size: slot * PARAMS_SLOTS,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let params_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kiln params"),
            layout: params_layout,
            entries: &[wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &params_buffer,
                    offset: 0,
                    size: wgpu::BufferSize::new(PARAMS_BYTES),
                }),
            }],
        });
        let errors: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock().unwrap().push(e.to_string());
        }));
        let lost = errors.clone();
        device.set_device_lost_callback(move |reason, message| {
            lost.lock()
                .unwrap()
                .push(format!("the device was lost ({reason:?}): {message}"));
        });
        let profiler = (timestamps
            && std::env::var_os("KILN_WGPU_PROFILE").is_some_and(|v| v == "1"))
        .then(|| Mutex::new(Profiler::new(&device, &queue)));
        Stream {
            profiler,
            device,
            queue,
            slot,
            params_buffer,
            params_group,
            rec: Mutex::new(Recording {
                encoder: None,
                pass: None,
                params: Vec::new(),
                first_slot: 0,
                dispatches: 0,
                piece: FIRST_PIECE,
            }),
            bind_groups: Mutex::new(HashMap::new()),
            dropped: Arc::default(),
            errors,
        }
    }

    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Where dropped buffers leave their ids.
    pub fn dropped(&self) -> Arc<Mutex<Vec<u64>>> {
        self.dropped.clone()
    }

    /// Any error wgpu reported since the last check, as a kiln error.
    pub fn check(&self) -> Result<()> {
        let mut errors = self.errors.lock().unwrap();
        if errors.is_empty() {
            return Ok(());
        }
        let all = errors.drain(..).collect::<Vec<_>>().join("; ");
        Err(Error::Device(format!("wgpu: {all}")))
    }

    /// Queue one dispatch of `kernel` over `groups` workgroups.
    pub fn dispatch(
        &self,
        kernel: &Kernel,
        bindings: &[Binding],
        params: &[u32],
        groups: (u32, u32, u32),
    ) -> Result<()> {
        debug_assert!(params.len() * 4 <= PARAMS_BYTES as usize);
        if groups.0 == 0 || groups.1 == 0 || groups.2 == 0 {
            return Ok(());
        }
        let key: BindKey = (
            kernel.name.clone(),
            bindings.iter().map(|b| (b.id, b.offset, b.size)).collect(),
        );
        let group = {
            let mut cache = self.bind_groups.lock().unwrap();
            cache
                .entry(key)
                .or_insert_with(|| {
                    let entries: Vec<wgpu::BindGroupEntry> = bindings
                        .iter()
                        .enumerate()
                        .map(|(i, b)| wgpu::BindGroupEntry {
                            binding: i as u32,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: b.buffer,
                                offset: b.offset,
                                size: wgpu::BufferSize::new(b.size),
                            }),
                        })
                        .collect();
                    self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(&kernel.name),
                        layout: &kernel.storage_layout,
                        entries: &entries,
                    })
                })
                .clone()
        };
        let mut rec = self.rec.lock().unwrap();
        let profile_full = self
            .profiler
            .as_ref()
            .is_some_and(|p| p.lock().unwrap().full());
        let ring_end = rec.first_slot + rec.dispatches == PARAMS_SLOTS;
        if ring_end || rec.dispatches == rec.piece || profile_full {
            rec.piece = (2 * rec.piece).min(SUBMIT_EVERY);
            drop(rec);
            self.flush()?;
            rec = self.rec.lock().unwrap();
            if ring_end {
                rec.first_slot = 0;
            }
        }
        let at = rec.dispatches * self.slot;
        let offset = rec.first_slot * self.slot + at;
        rec.params.resize(at as usize, 0);
        rec.params
            .extend(params.iter().flat_map(|w| w.to_le_bytes()));
        rec.params.resize((at + PARAMS_BYTES) as usize, 0);
        rec.dispatches += 1;
        if rec.pass.is_none() {
            let encoder = rec.encoder.get_or_insert_with(|| {
                self.device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
            });
            let pass = encoder
                .begin_compute_pass(&wgpu::ComputePassDescriptor::default())
                .forget_lifetime();
            rec.pass = Some(pass);
        }
        let pass = rec.pass.as_mut().unwrap();
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, &group, &[]);
        pass.set_bind_group(1, &self.params_group, &[offset as u32]);
        match &self.profiler {
            Some(p) => {
                let mut p = p.lock().unwrap();
                let i = p.names.len() as u32;
                pass.write_timestamp(&p.queries, 2 * i);
                pass.dispatch_workgroups(groups.0, groups.1, groups.2);
                pass.write_timestamp(&p.queries, 2 * i + 1);
                // The grid tells one shape of a kernel from another in the report.
                p.names
                    .push(format!("{} [{}×{}]", kernel.name, groups.0, groups.1));
            }
            None => pass.dispatch_workgroups(groups.0, groups.1, groups.2),
        }
        Ok(())
    }

    /// Record something on the encoder outside a compute pass (a copy), in order with
    /// the dispatches before and after it.
    pub fn encode(&self, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut rec = self.rec.lock().unwrap();
        rec.pass = None;
        let encoder = rec.encoder.get_or_insert_with(|| {
            self.device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
        });
        f(encoder);
    }

    /// Whether nothing is recorded (so a queue write lands in order).
    pub fn is_idle(&self) -> bool {
        self.rec.lock().unwrap().encoder.is_none()
    }

    /// Submit what is recorded (parameters first).
    pub fn flush(&self) -> Result<()> {
        let mut rec = self.rec.lock().unwrap();
        rec.pass = None;
        if let Some(mut encoder) = rec.encoder.take() {
            if !rec.params.is_empty() {
                let at = rec.first_slot * self.slot;
                self.queue
                    .write_buffer(&self.params_buffer, at, &rec.params);
            }
            if let Some(p) = &self.profiler {
                p.lock().unwrap().resolve(&mut encoder);
            }
            self.queue.submit([encoder.finish()]);
            if let Some(p) = &self.profiler {
                p.lock().unwrap().collect(&self.device);
            }
        }
        rec.params.clear();
        rec.first_slot += rec.dispatches;
        rec.dispatches = 0;
        drop(rec);
        let dropped: Vec<u64> = std::mem::take(&mut *self.dropped.lock().unwrap());
        if !dropped.is_empty() {
            self.bind_groups
                .lock()
                .unwrap()
                .retain(|(_, ids), _| !ids.iter().any(|(id, _, _)| dropped.contains(id)));
        }
        self.check()
    }

    /// Per-kernel GPU time so far when profiling (`KILN_WGPU_PROFILE=1`): (kernel,
    /// dispatches, total ms), largest first.
    pub fn profile(&self) -> Option<Vec<(String, u64, f64)>> {
        self.profiler.as_ref().map(|p| p.lock().unwrap().report())
    }

    /// Submit and wait until the GPU has finished everything.
    pub fn finish(&self) -> Result<()> {
        self.flush()?;
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Device(format!("wgpu: waiting for the GPU: {e}")))?;
        self.rec.lock().unwrap().piece = FIRST_PIECE;
        self.check()
    }
}
