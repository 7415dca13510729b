//! Ranks that are threads of one process, summing their tensors through host memory: each
//! rank copies its tensor out (as F32), waits for the others, adds all of them up in rank
//! order, so that every rank gets the same bits, and writes the sum back. Slow next to
//! NCCL, and meant for what needs no speed: the tensor-parallel model's tests on the CPU,
//! where it stands in for NCCL with the same contract.

use crate::gate::Gate;
use kiln_core::collective::{check_parts, check_span};
use kiln_core::{quant, Backend, Collective, DType, Error, Result, Tensor};
use std::sync::{Arc, Mutex};

struct Shared {
    /// Each rank's values for the reduction under way.
    slots: Mutex<Vec<Vec<f32>>>,
    barrier: Gate,
}

/// Refuse what the host group does not gather or scatter (F32 only).
fn only_f32(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 => Ok(()),
        other => Err(Error::unsupported(format!("{op} of {other} tensors (F32)"))),
    }
}

/// One rank of a [`group`].
pub struct HostCollective {
    rank: usize,
    world: usize,
    backend: Arc<dyn Backend>,
    shared: Arc<Shared>,
}

/// A group of `backends.len()` ranks, rank `i` computing on `backends[i]`; hand each
/// rank's collective to its thread.
pub fn group(backends: Vec<Arc<dyn Backend>>) -> Vec<HostCollective> {
    let world = backends.len();
    let shared = Arc::new(Shared {
        slots: Mutex::new(vec![Vec::new(); world]),
        barrier: Gate::new(world),
    });
    backends
        .into_iter()
        .enumerate()
        .map(|(rank, backend)| HostCollective {
            rank,
            world,
            backend,
            shared: shared.clone(),
        })
        .collect()
}

/// Refuse what the host group does not sum (F32, F16, BF16).
fn sum_type(op: &str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => Ok(dtype),
        other => Err(Error::unsupported(format!(
            "{op} of {other} tensors (F32, F16, BF16)"
        ))),
    }
}

impl HostCollective {
    /// Every rank's `mine` summed elementwise in rank order (the same bits on every rank).
    fn sum(&self, op: &str, mine: Vec<f32>) -> Result<Vec<f32>> {
        let n = mine.len();
        let slots = || self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots()[self.rank] = mine;
        self.shared.barrier.wait()?;
        let sum = {
            let all = slots();
            if all.iter().any(|v| v.len() != n) {
                drop(all);
                self.shared.barrier.wait()?;
                return Err(Error::shape(format!(
                    "{op}: the ranks' tensors differ in size (rank {} has {n} values)",
                    self.rank
                )));
            }
            let mut sum = all[0].clone();
            for other in &all[1..] {
                sum.iter_mut().zip(other).for_each(|(s, v)| *s += v);
            }
            sum
        };
        // No rank overwrites its slot for the next reduction before all have read this one.
        self.shared.barrier.wait()?;
        Ok(sum)
    }
}

impl Collective for HostCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<()> {
        let dtype = sum_type("all-reduce", t.dtype())?;
        let n = t.shape().numel();
        let mine = quant::dequantize_to_vec(dtype, &self.backend.download(t)?, n)?;
        let sum = self.sum("all-reduce", mine)?;
        self.backend.write(t, &quant::quantize(dtype, &sum)?)
    }

    /// Summed at once: a CPU's ops have run by the time they return, and a GPU rank's
    /// are synchronised by the download, so there is nothing to overlap here.
    fn start_sum(&self, t: &mut Tensor, offset: usize, len: usize) -> Result<()> {
        check_span("sum of a span", t, offset, len)?;
        let dtype = sum_type("sum of a span", t.dtype())?;
        let n = t.shape().numel();
        let mut all = quant::dequantize_to_vec(dtype, &self.backend.download(t)?, n)?;
        let span = offset..offset + len;
        let sum = self.sum("sum of a span", all[span.clone()].to_vec())?;
        all[span].copy_from_slice(&sum);
        self.backend.write(t, &quant::quantize(dtype, &all)?)
    }

    fn wait_started(&self) -> Result<()> {
        Ok(())
    }

    fn all_gather(&self, part: &Tensor, whole: &mut Tensor) -> Result<()> {
        let (dtype, n) = (part.dtype(), part.shape().numel());
        check_parts("all-gather", self.world, part, whole)?;
        only_f32("all-gather", dtype)?;
        let mine = quant::dequantize_to_vec(dtype, &self.backend.download(part)?, n)?;
        let slots = || self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots()[self.rank] = mine;
        self.shared.barrier.wait()?;
        let all: Vec<f32> = {
            let all = slots();
            if all.iter().any(|v| v.len() != n) {
                drop(all);
                self.shared.barrier.wait()?;
                return Err(Error::shape(format!(
                    "all-gather: the ranks' parts differ in size (rank {} has {n} values)",
                    self.rank
                )));
            }
            all.concat()
        };
        self.shared.barrier.wait()?;
        self.backend.write(whole, &quant::quantize(dtype, &all)?)
    }

    fn reduce_scatter_sum(&self, whole: &Tensor, part: &mut Tensor) -> Result<()> {
        let n = part.shape().numel();
        check_parts("reduce-scatter", self.world, part, whole)?;
        only_f32("reduce-scatter", part.dtype())?;
        let mine =
            quant::dequantize_to_vec(DType::F32, &self.backend.download(whole)?, n * self.world)?;
        let slots = || self.shared.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots()[self.rank] = mine;
        self.shared.barrier.wait()?;
        let chunk = {
            let all = slots();
            if all.iter().any(|v| v.len() != n * self.world) {
                drop(all);
                self.shared.barrier.wait()?;
                return Err(Error::shape(format!(
                    "reduce-scatter: the ranks' tensors differ in size (rank {} has {})",
                    self.rank,
                    n * self.world
                )));
            }
            let at = self.rank * n;
            let mut sum = all[0][at..at + n].to_vec();
            for other in &all[1..] {
                sum.iter_mut()
                    .zip(&other[at..at + n])
                    .for_each(|(s, v)| *s += v);
            }
            sum
        };
        self.shared.barrier.wait()?;
        self.backend
            .write(part, &quant::quantize(DType::F32, &chunk)?)
    }

    fn check(&self) -> Result<()> {
        match self.shared.barrier.broken() {
            Some(why) => Err(Error::Device(why)),
            None => Ok(()),
        }
    }

    fn abort(&self, why: &str) {
        self.shared
            .barrier
            .break_with(format!("rank {} stopped: {why}", self.rank));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::{HostBytes, Shape};
    use kiln_cpu::CpuBackend;

    /// Rank `r` holds `10 r + i` at `i` and runs `op` on it; what each rank then holds.
    fn run(
        sizes: &[usize],
        op: fn(&HostCollective, &mut Tensor) -> Result<()>,
    ) -> Vec<Result<Vec<f32>>> {
        let backends: Vec<Arc<dyn Backend>> = sizes
            .iter()
            .map(|_| Arc::new(CpuBackend::new(Some(1)).unwrap()) as Arc<dyn Backend>)
            .collect();
        let threads: Vec<_> = group(backends.clone())
            .into_iter()
            .zip(backends)
            .zip(sizes.iter().copied())
            .map(|((c, b), n)| {
                std::thread::spawn(move || {
                    let values: Vec<f32> = (0..n).map(|i| (c.rank() * 10 + i) as f32).collect();
                    let mut t = b.upload(
                        DType::F32,
                        Shape::new(vec![1, n]).unwrap(),
                        HostBytes::from_vec(quant::quantize(DType::F32, &values).unwrap()),
                    )?;
                    op(&c, &mut t)?;
                    quant::dequantize_to_vec(DType::F32, &b.download(&t)?, n)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_gets_the_sum() {
        for got in run(&[5, 5, 5], |c, t| c.all_reduce_sum(t)) {
            // Σ_r (10 r + i) = 30 + 3 i.
            let want: Vec<f32> = (0..5).map(|i| (30 + 3 * i) as f32).collect();
            assert_eq!(got.unwrap(), want);
        }
    }

    #[test]
    fn a_started_sum_sums_its_span_alone() {
        let span = |c: &HostCollective, t: &mut Tensor| {
            c.start_sum(t, 2, 3)?;
            c.wait_started()
        };
        for (rank, got) in run(&[7, 7, 7], span).into_iter().enumerate() {
            let want: Vec<f32> = (0..7)
                .map(|i| match i {
                    2..5 => (30 + 3 * i) as f32,
                    _ => (10 * rank + i) as f32,
                })
                .collect();
            assert_eq!(got.unwrap(), want);
        }
        for bad in run(&[7, 7], |c, t| c.start_sum(t, 5, 3)) {
            let e = bad.unwrap_err().to_string();
            assert!(e.contains("values 5..5+3 of a tensor of 7"), "{e}");
        }
    }

    #[test]
    fn a_rank_that_stops_ends_the_others_waiting_for_it() {
        let backends: Vec<Arc<dyn Backend>> = (0..3)
            .map(|_| Arc::new(CpuBackend::new(Some(1)).unwrap()) as Arc<dyn Backend>)
            .collect();
        let mut group = group(backends.clone());
        let quitter = group.remove(2);
        let waiting: Vec<_> = group
            .into_iter()
            .zip(backends)
            .map(|(c, b)| {
                std::thread::spawn(move || {
                    let mut t = b
                        .upload(
                            DType::F32,
                            Shape::new(vec![1, 2]).unwrap(),
                            HostBytes::from_vec(quant::quantize(DType::F32, &[1.0, 2.0]).unwrap()),
                        )
                        .unwrap();
                    c.all_reduce_sum(&mut t).unwrap_err().to_string()
                })
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        quitter.abort("its GPU is out of memory");
        for w in waiting {
            let e = w.join().unwrap();
            assert!(
                e.contains("rank 2 stopped: its GPU is out of memory"),
                "{e}"
            );
        }
    }

    #[test]
    fn every_rank_gets_the_parts_in_rank_order() {
        let backends: Vec<Arc<dyn Backend>> = (0..3)
            .map(|_| Arc::new(CpuBackend::new(Some(1)).unwrap()) as Arc<dyn Backend>)
            .collect();
        let threads: Vec<_> = group(backends.clone())
            .into_iter()
            .zip(backends)
            .map(|(c, b)| {
                std::thread::spawn(move || {
                    let mine: Vec<f32> = (0..2).map(|i| (c.rank() * 10 + i) as f32).collect();
                    let part = b
                        .upload(
                            DType::F32,
                            Shape::new(vec![1, 2]).unwrap(),
                            HostBytes::from_vec(quant::quantize(DType::F32, &mine).unwrap()),
                        )
                        .unwrap();
                    let mut whole = b
                        .zeros(DType::F32, Shape::new(vec![1, 6]).unwrap())
                        .unwrap();
                    c.all_gather(&part, &mut whole).unwrap();
                    quant::dequantize_to_vec(DType::F32, &b.download(&whole).unwrap(), 6).unwrap()
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap(), [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
        }
    }

    #[test]
    fn ranks_with_different_sizes_all_fail_and_none_hangs() {
        for got in run(&[4, 5], |c, t| c.all_reduce_sum(t)) {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("differ in size"), "{e}");
        }
    }
}
