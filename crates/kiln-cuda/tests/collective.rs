//! NCCL through the CUDA backend: one rank (any GPU machine), and a rank on every GPU of
//! the machine, each on its own thread as a tensor-parallel run would have them, summing
//! tensors of decode's and of training's sizes; the sums against the exact ones, and the
//! time per all-reduce printed (`--nocapture`).

use kiln_core::{quant, Backend, Collective, DType, HostBytes, Shape, Tensor};
use kiln_cuda::{CudaBackend, NcclId};
use std::sync::{Arc, Barrier};
use std::time::Instant;

fn upload(b: &CudaBackend, dtype: DType, values: &[f32]) -> Tensor {
    b.upload(
        dtype,
        Shape::new(vec![1, values.len()]).unwrap(),
        HostBytes::from_vec(quant::quantize(dtype, values).unwrap()),
    )
    .unwrap()
}

fn download(b: &CudaBackend, t: &Tensor) -> Vec<f32> {
    quant::dequantize_to_vec(t.dtype(), &b.download(t).unwrap(), t.shape().numel()).unwrap()
}

/// Rank `r`'s value at element `i`: small integers, so that every partial sum is exact in
/// f32 and bf16 alike, whatever order NCCL adds them in.
fn value(r: usize, i: usize) -> f32 {
    ((r * 7 + i * 3) % 13) as f32 - 6.0
}

/// This machine's GPUs when there are several; else `None`, saying the test is skipped.
fn several_gpus() -> Option<usize> {
    let gpus = kiln_cuda::devices().unwrap().len();
    if gpus < 2 {
        eprintln!("SKIPPED: one GPU here; collectives between GPUs need two or more");
        return None;
    }
    Some(gpus)
}

#[test]
fn an_id_is_128_bytes() {
    assert!(NcclId::from_bytes(&[0u8; 128]).is_ok());
    let err = NcclId::from_bytes(&[0u8; 12]).unwrap_err().to_string();
    assert!(err.contains("128 bytes, not 12"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn one_rank_all_reduce_is_the_identity() {
    let b = CudaBackend::new(0).unwrap();
    if !kiln_cuda::nccl_available() {
        panic!("NCCL is not installed on this GPU machine");
    }
    let comm = b.communicator(&NcclId::new().unwrap(), 0, 1).unwrap();
    let values: Vec<f32> = (0..1000).map(|i| value(0, i)).collect();
    let mut t = upload(&b, DType::F32, &values);
    comm.all_reduce_sum(&mut t).unwrap();
    assert_eq!(download(&b, &t), values);
    // What a collective cannot take is an error, not a crash.
    let mut q = b
        .upload(
            DType::Q8_0,
            Shape::new(vec![1, 32]).unwrap(),
            HostBytes::from_vec(quant::quantize(DType::Q8_0, &[1.0; 32]).unwrap()),
        )
        .unwrap();
    assert!(comm.all_reduce_sum(&mut q).is_err());
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_rank_on_every_gpu_sums_its_tensors() {
    let Some(gpus) = several_gpus() else {
        return;
    };
    let id = NcclId::new().unwrap();
    let barrier = Arc::new(Barrier::new(gpus));
    let threads: Vec<_> = (0..gpus)
        .map(|rank| {
            let (id, barrier) = (id.clone(), barrier.clone());
            std::thread::spawn(move || {
                let b = CudaBackend::new(rank).unwrap();
                let comm = b.communicator(&id, rank, gpus).unwrap();
                let mut lines = Vec::new();
                // A decode step's hidden state (4096 or 8192 values), training's buckets.
                for (dtype, n) in [
                    (DType::F32, 4096),
                    (DType::BF16, 8192),
                    (DType::F32, 256 << 10),
                    (DType::BF16, 4 << 20),
                    (DType::F32, 16 << 20),
                ] {
                    let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
                    let mut t = upload(&b, dtype, &mine);
                    comm.all_reduce_sum(&mut t).unwrap();
                    let got = download(&b, &t);
                    for (i, &g) in got.iter().enumerate() {
                        let want: f32 = (0..gpus).map(|r| value(r, i)).sum();
                        assert_eq!(g, want, "rank {rank}, {dtype} × {n}, element {i}");
                    }
                    // Time: the same reduction, 20 in a row, after a barrier.
                    barrier.wait();
                    b.synchronize().unwrap();
                    let started = Instant::now();
                    for _ in 0..20 {
                        comm.all_reduce_sum(&mut t).unwrap();
                    }
                    b.synchronize().unwrap();
                    let us = started.elapsed().as_secs_f64() * 1e6 / 20.0;
                    let bytes = n * if dtype == DType::F32 { 4 } else { 2 };
                    lines.push(format!(
                        "rank {rank}: {dtype} × {n} ({} KiB): {us:.1} µs, bus {:.1} GB/s",
                        bytes >> 10,
                        // NCCL's bus bandwidth: 2(n-1)/n of the bytes cross each link.
                        bytes as f64 * 2.0 * (gpus - 1) as f64 / gpus as f64 / us / 1e3
                    ));
                }
                lines
            })
        })
        .collect();
    for t in threads {
        for line in t.join().expect("a rank panicked") {
            println!("{line}");
        }
    }
}

/// The one-shot path (ranks of one process on a `PeerBoard`), forced for every size it
/// takes: sums of decode's sizes exact on every rank, eagerly and replayed from a
/// recorded graph with new values each time (the epochs and parities on the device), and
/// what NCCL keeps (BF16, an odd length) still right. Then a board that
/// measures prints where the one-shot path pays (`--nocapture`).
#[test]
#[ignore = "needs a CUDA device"]
fn one_shot_sums_match_on_every_rank() {
    use kiln_cuda::PeerBoard;
    let Some(gpus) = several_gpus() else {
        return;
    };
    for world in (2..=gpus).filter(|w| *w == 2 || *w == gpus) {
        let (id, id2) = (NcclId::new().unwrap(), NcclId::new().unwrap());
        let forced = PeerBoard::with_max_bytes(world, Some(1 << 20));
        let measured = PeerBoard::with_max_bytes(world, None);
        let lines: Vec<Vec<String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (id, id2, forced, measured) = (&id, &id2, &forced, &measured);
                    s.spawn(move || {
                        let b = Arc::new(CudaBackend::new(rank).unwrap());
                        let comm = b.communicator_in_process(id, forced, rank, world).unwrap();
                        assert_eq!(comm.one_shot().map(|o| o.0), Some(1 << 20));
                        let check = |t: &Tensor, n: usize, salt: usize, what: &str| {
                            let got = download(&b, t);
                            for (i, &g) in got.iter().enumerate().take(n) {
                                let want: f32 = (0..world).map(|r| value(r + salt, i)).sum();
                                assert_eq!(g, want, "rank {rank} of {world}, {what}, element {i}");
                            }
                        };
                        for (dtype, n) in [
                            (DType::F32, 4096),
                            (DType::F32, 8192),
                            (DType::F32, 4100),
                            (DType::F32, 1 << 18),
                            (DType::F32, 4099),
                            (DType::BF16, 8192),
                        ] {
                            for salt in 0..3 {
                                let mine: Vec<f32> =
                                    (0..n).map(|i| value(rank + salt, i)).collect();
                                let mut t = upload(&b, dtype, &mine);
                                comm.all_reduce_sum(&mut t).unwrap();
                                check(&t, n, salt, &format!("{dtype} × {n}"));
                            }
                        }
                        // Recorded once, replayed with new values: every replay advances
                        // the epochs on the device.
                        let n = 4096;
                        let mut t = upload(&b, DType::F32, &vec![0.0; n]);
                        let replay = b
                            .capture(&mut || comm.all_reduce_sum(&mut t))
                            .unwrap()
                            .expect("CUDA records");
                        for salt in 0..5 {
                            let mine: Vec<f32> = (0..n).map(|i| value(rank + salt, i)).collect();
                            b.write(&mut t, &quant::quantize(DType::F32, &mine).unwrap())
                                .unwrap();
                            replay.replay().unwrap();
                            check(&t, n, salt, "replayed");
                        }
                        drop(replay);
                        drop(comm);
                        // A measured board: what was timed, both ways.
                        b.communicator_in_process(id2, measured, rank, world)
                            .unwrap()
                            .one_shot()
                            .map(|(max, probes)| {
                                let mut lines =
                                    vec![format!("{world} GPUs: one-shot up to {} KiB", max >> 10)];
                                for p in probes {
                                    lines.push(format!(
                                        "  {} KiB: NCCL {:.1} µs, one-shot {:.1} µs",
                                        p.bytes >> 10,
                                        p.nccl_us,
                                        p.one_shot_us
                                    ));
                                }
                                lines
                            })
                            .unwrap_or_else(|| vec![format!("{world} GPUs: one-shot off")])
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a rank panicked"))
                .collect()
        });
        for line in &lines[0] {
            println!("{line}");
        }
    }
}

/// All-gather and reduce-scatter through NCCL on every GPU: exact (small integers), in
/// rank order, and what cannot be taken an error.
#[test]
#[ignore = "needs a CUDA device"]
fn gathers_and_scatters_are_exact_in_rank_order() {
    let Some(gpus) = several_gpus() else {
        return;
    };
    let id = NcclId::new().unwrap();
    std::thread::scope(|s| {
        for rank in 0..gpus {
            let id = &id;
            s.spawn(move || {
                let b = CudaBackend::new(rank).unwrap();
                let comm = b.communicator(id, rank, gpus).unwrap();
                // Gather: every rank's 1000 values one after another.
                let n = 1000;
                let part = upload(
                    &b,
                    DType::F32,
                    &(0..n).map(|i| value(rank, i)).collect::<Vec<_>>(),
                );
                let mut whole = upload(&b, DType::F32, &vec![0.0; n * gpus]);
                comm.all_gather(&part, &mut whole).unwrap();
                let got = download(&b, &whole);
                for (j, g) in got.iter().enumerate() {
                    assert_eq!(*g, value(j / n, j % n), "rank {rank}, gathered value {j}");
                }
                // Scatter: chunk `rank` of the sum.
                let whole: Vec<f32> = (0..n * gpus).map(|i| value(rank, i)).collect();
                let whole = upload(&b, DType::F32, &whole);
                let mut part = upload(&b, DType::F32, &vec![0.0; n]);
                comm.reduce_scatter_sum(&whole, &mut part).unwrap();
                for (i, g) in download(&b, &part).iter().enumerate() {
                    let want: f32 = (0..gpus).map(|r| value(r, rank * n + i)).sum();
                    assert_eq!(*g, want, "rank {rank}, scattered value {i}");
                }
                let mut wrong = upload(&b, DType::F32, &vec![0.0; n + 1]);
                assert!(comm.reduce_scatter_sum(&whole, &mut wrong).is_err());
                assert!(comm.all_gather(&part, &mut wrong).is_err());
            });
        }
    });
}

/// Started sums (gradient buckets) run on the communicator's own stream: each waits for
/// the kernels queued before it (the doubling), and the kernels queued after
/// `wait_started` (the halving) wait for them. Spans started from the end, as a backward
/// pass makes them; the values before the first span stay this rank's own.
#[test]
#[ignore = "needs a CUDA device"]
fn started_sums_wait_for_the_kernels_before_and_are_waited_for() {
    let Some(gpus) = several_gpus() else {
        return;
    };
    let id = NcclId::new().unwrap();
    let (n, spans) = (
        3_000_001,
        [
            (2_000_000, 1_000_001),
            (1_000_000, 1_000_000),
            (17, 999_983),
        ],
    );
    std::thread::scope(|s| {
        for rank in 0..gpus {
            let id = &id;
            s.spawn(move || {
                let b = CudaBackend::new(rank).unwrap();
                let comm = b.communicator(id, rank, gpus).unwrap();
                let mine: Vec<f32> = (0..n).map(|i| value(rank, i)).collect();
                let mut t = upload(&b, DType::F32, &mine);
                let mut busy = upload(&b, DType::F32, &vec![1.0; 1 << 24]);
                b.scale(&mut t, 2.0).unwrap();
                for &(at, len) in &spans {
                    comm.start_sum(&mut t, at, len).unwrap();
                    b.scale(&mut busy, 1.5).unwrap();
                }
                comm.wait_started().unwrap();
                b.scale(&mut t, 0.5).unwrap();
                let got = download(&b, &t);
                for (i, g) in got.iter().enumerate() {
                    let want = match spans.iter().any(|&(at, len)| (at..at + len).contains(&i)) {
                        true => (0..gpus).map(|r| value(r, i)).sum(),
                        false => value(rank, i),
                    };
                    assert_eq!(*g, want, "rank {rank}, value {i}");
                }
                assert!(comm.start_sum(&mut t, n - 1, 2).is_err());
                assert!(comm.start_sum(&mut t, 5, 0).is_err());
            });
        }
    });
}
