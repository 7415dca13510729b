//! Host data to and from the GPU, for the tests that build their operands by hand.

use kiln_core::{Backend, DType, HostBytes, Shape, Tensor};
use kiln_cuda::CudaBackend;

fn upload(b: &CudaBackend, dtype: DType, dims: &[usize], bytes: Vec<u8>) -> Tensor {
    b.upload(
        dtype,
        Shape::new(dims.to_vec()).unwrap(),
        HostBytes::from_vec(bytes),
    )
    .unwrap()
}

pub fn upload_f32(b: &CudaBackend, dims: &[usize], v: &[f32]) -> Tensor {
    upload(
        b,
        DType::F32,
        dims,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

pub fn upload_i32(b: &CudaBackend, dims: &[usize], v: &[i32]) -> Tensor {
    upload(
        b,
        DType::I32,
        dims,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

pub fn read(b: &CudaBackend, t: &Tensor) -> Vec<f32> {
    b.download(t)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
