//! kvfabric-benches — criterion micro-benchmarks of kvfabric's hot paths.
//!
//! The benchmarks live in `benches/benches/`; run them with `cargo bench -p kvfabric-benches`.
//! Each one measures, in the same run, the machine's own bound for the same work (raw XXH3,
//! memcpy, a plain socket, O_DIRECT), so that results are read as ratios, not absolute numbers.
