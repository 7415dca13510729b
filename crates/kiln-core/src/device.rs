use std::fmt;

/// Where a buffer lives. A variant is added when its backend exists, not before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// An NVIDIA GPU, by CUDA ordinal.
    Cuda(usize),
    /// A GPU reached through wgpu (Vulkan, Metal, DX12), by its index in kiln's adapter list.
    Wgpu(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Wgpu(i) => write!(f, "wgpu:{i}"),
        }
    }
}
