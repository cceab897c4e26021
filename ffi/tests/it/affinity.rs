//! The C ABI's threads leave the cores an engine pinned the calling thread to: an agent and a
//! store (with a disk tier, whose I/O thread the store starts) created from a thread pinned to
//! one CPU run their threads on every CPU the process may use, unless `cpus` says `inherit`
//! or names CPUs. (vLLM's CPU backend pins its workers this way; four of them on this 2-core
//! machine all pinned to core 0 starved kvfabric's copies past their deadline.)

use std::collections::BTreeSet;

use kvfabric::affinity::{self, CpuSet};
use kvfabric_ffi::{kvf_agent, kvf_config, kvf_store};

/// This process's threads named `kvfabric-*`: id → (name, allowed CPUs).
fn kvfabric_threads() -> Vec<(u32, (String, Vec<usize>))> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let dir = e.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("kvfabric-") {
            continue;
        }
        let status = std::fs::read_to_string(dir.join("status")).unwrap_or_default();
        let Some(list) = status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")) else {
            continue;
        };
        let cpus = list
            .trim()
            .split(',')
            .flat_map(|part| match part.split_once('-') {
                Some((a, b)) => a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap(),
                None => part.parse::<usize>().unwrap()..=part.parse::<usize>().unwrap(),
            })
            .collect();
        let tid = e.file_name().to_string_lossy().parse().unwrap();
        out.push((tid, (comm.trim().to_string(), cpus)));
    }
    out
}

/// From a thread pinned to `pin`: an agent and a store with `cpus`; the names and CPUs of the
/// threads they started.
fn threads_started(pin: usize, cpus: Option<&str>) -> Vec<(String, Vec<usize>)> {
    let cpus = cpus.map(str::to_string);
    std::thread::spawn(move || {
        CpuSet::List(vec![pin]).apply_to_current_thread().unwrap();
        let before: BTreeSet<u32> = kvfabric_threads().into_iter().map(|(t, _)| t).collect();
        let dir = tempfile::tempdir().unwrap();
        let mut c = kvf_config::default();
        c.set("secret", "affinity").unwrap();
        c.set("block_bytes", "4096").unwrap();
        c.set("host_blocks", "8").unwrap();
        c.set("disk_path", dir.path().join("g3").to_str().unwrap()).unwrap();
        c.set("disk_blocks", "8").unwrap();
        if let Some(cpus) = &cpus {
            c.set("cpus", cpus).unwrap();
        }
        let agent = kvf_agent::new(&c).unwrap();
        let store = kvf_store::new(&agent, &c).unwrap();
        // The runtime's workers and the disk I/O thread, once each has named itself (a
        // thread sets its name after it starts).
        let new = || -> Vec<(String, Vec<usize>)> {
            kvfabric_threads()
                .into_iter()
                .filter(|(t, _)| !before.contains(t))
                .map(|(_, thread)| thread)
                .collect()
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut started = new();
        while !started.iter().any(|(n, _)| is_io(n)) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            started = new();
        }
        drop(store);
        drop(agent);
        started
    })
    .join()
    .unwrap()
}

/// The disk tier's I/O thread (io_uring, or the pread fallback's).
fn is_io(name: &str) -> bool {
    name.starts_with("kvfabric-uring") || name.starts_with("kvfabric-pread")
}

#[test]
fn the_c_abis_threads_leave_the_engines_pinned_core() {
    let all = std::thread::spawn(|| {
        CpuSet::All.apply_to_current_thread().unwrap();
        affinity::current_thread().unwrap()
    })
    .join()
    .unwrap();
    if all.len() < 2 {
        eprintln!("one CPU allowed here: nothing to show");
        return;
    }
    let pin = all[0];
    // The runtime's two workers and the disk tier's I/O thread at least, each on `cpus`.
    let check = |threads: &[(String, Vec<usize>)], want: &[usize], what: &str| {
        let ffi = threads.iter().filter(|(n, _)| n == "kvfabric-ffi").count();
        let io = threads.iter().filter(|(n, _)| is_io(n)).count();
        assert!(ffi >= 2 && io >= 1, "{what}: {threads:?}");
        assert!(threads.iter().all(|(_, c)| c == want), "{what}: all on {want:?}: {threads:?}");
    };
    check(&threads_started(pin, None), &all, "default `cpus`: every CPU");
    check(&threads_started(pin, Some("inherit")), &[pin], "`inherit`: the pinned CPU");
    let last = *all.last().unwrap();
    check(&threads_started(pin, Some(&last.to_string())), &[last], "a list");
    let mut c = kvf_config::default();
    c.set("secret", "affinity").unwrap();
    c.set("cpus", "3-1").unwrap();
    let err = kvf_agent::new(&c).unwrap_err();
    assert!(err.to_string().contains("cpus"), "{err}");
}
