//! Per-kernel GPU time from timestamp queries written around each dispatch inside the
//! compute pass (`TIMESTAMP_QUERY_INSIDE_PASSES`). Turned on by `KILN_WGPU_PROFILE=1`:
//! the timestamps and the read-back after every submission cost time of their own.

use std::collections::HashMap;

/// Dispatches timed per submission (two queries each, within wgpu's 4096 per set).
pub(crate) const SLOTS: u32 = 2048;

pub(crate) struct Profiler {
    pub queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    readback: wgpu::Buffer,
    /// Kernel of each timed dispatch of the current submission.
    pub names: Vec<String>,
    /// Per kernel: dispatches and nanoseconds.
    totals: HashMap<String, (u64, f64)>,
    period_ns: f64,
}

impl Profiler {
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        let bytes = u64::from(SLOTS) * 2 * 8;
        Profiler {
            queries: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("kiln profile"),
                ty: wgpu::QueryType::Timestamp,
                count: SLOTS * 2,
            }),
            resolved: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln profile"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }),
            readback: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kiln profile readback"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            names: Vec::new(),
            totals: HashMap::new(),
            period_ns: f64::from(queue.get_timestamp_period()),
        }
    }

    pub fn full(&self) -> bool {
        self.names.len() as u32 == SLOTS
    }

    /// Before the submission: copy the timestamps where they can be read.
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        let n = self.names.len() as u32 * 2;
        if n > 0 {
            encoder.resolve_query_set(&self.queries, 0..n, &self.resolved, 0);
            encoder.copy_buffer_to_buffer(&self.resolved, 0, &self.readback, 0, u64::from(n) * 8);
        }
    }

    /// After the submission has finished: add each dispatch's time to its kernel's.
    pub fn collect(&mut self, device: &wgpu::Device) {
        let n = self.names.len();
        if n == 0 {
            return;
        }
        let slice = self.readback.slice(..(n as u64) * 16);
        slice.map_async(wgpu::MapMode::Read, |_| {});
        let _ = device.poll(wgpu::PollType::wait_indefinitely());
        if let Ok(view) = slice.get_mapped_range() {
            for (i, name) in self.names.iter().enumerate() {
                let at = |j: usize| u64::from_le_bytes(view[j * 8..j * 8 + 8].try_into().unwrap());
                let ticks = at(2 * i + 1).saturating_sub(at(2 * i));
                let e = self.totals.entry(name.clone()).or_default();
                e.0 += 1;
                e.1 += ticks as f64 * self.period_ns;
            }
        }
        self.readback.unmap();
        self.names.clear();
    }

    /// (kernel, dispatches, total ms), the largest total first.
    pub fn report(&self) -> Vec<(String, u64, f64)> {
        let mut rows: Vec<_> = self
            .totals
            .iter()
            .map(|(k, &(n, ns))| (k.clone(), n, ns / 1e6))
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        rows
    }
}
