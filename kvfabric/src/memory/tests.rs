use super::*;

/// A GPU region registered at an address no CPU may touch: every host access is refused
/// before any pointer is formed (this proves the refusal, not anything about a GPU).
#[test]
fn host_access_to_a_device_region_is_refused_and_its_addresses_are_checked() {
    let table = RegionTable::new("kvfabric.test-device", 8, ShmSeal::new(b"test"), "test");
    let mem =
        DeviceMemory { addr: 0x7f00_0000_0000, len: 4096, ordinal: 1, owner: None, ipc: None };
    // SAFETY: nothing dereferences a device region's address: that is what this checks.
    let r = unsafe { table.register_device(mem, true) }.unwrap();
    assert_eq!(r.kind(), MemoryKind::Device(1));
    let refused = |e: MemoryError| {
        assert!(matches!(e, MemoryError::NotHostMemory { ordinal: 1, .. }), "{e}");
        assert_eq!(e.kind(), MemoryErrorKind::NotHostMemory);
    };
    refused(r.write_at(0, &[1, 2, 3]).unwrap_err());
    refused(r.read_at(0, &mut [0; 3]).unwrap_err());
    refused(r.fill(0, 10, 0).unwrap_err());
    refused(r.checksum(0, 10).unwrap_err());
    refused(r.ptr_at(0, 10).unwrap_err());
    // SAFETY: refused before any slice is formed.
    refused(unsafe { r.view(0, 10) }.unwrap_err());
    // SAFETY: as above.
    refused(unsafe { r.view_mut(0, 10) }.unwrap_err());
    let host = table.alloc(4096, RegionOptions::default()).unwrap();
    refused(copy_between(&host, 0, &r, 0, 16).unwrap_err());
    refused(copy_between(&r, 0, &host, 0, 16).unwrap_err());
    assert_eq!(r.device_addr(4000, 96), Some((1, 0x7f00_0000_0000 + 4000)));
    assert_eq!(r.device_addr(4000, 97), None);
    assert_eq!(r.device_addr(u64::MAX, 2), None);
    assert_eq!(host.device_addr(0, 1), None);
    // Address 0 and zero lengths are refused.
    let null = DeviceMemory { addr: 0, len: 1, ordinal: 0, owner: None, ipc: None };
    // SAFETY: refused before registration.
    let r0 = unsafe { table.register_device(null, false) };
    assert!(matches!(r0, Err(MemoryError::NullAddress)));
    let empty = DeviceMemory { addr: 4096, len: 0, ordinal: 0, owner: None, ipc: None };
    // SAFETY: as above.
    let r0 = unsafe { table.register_device(empty, false) };
    assert!(matches!(r0, Err(MemoryError::ZeroLength)));
    // An owner value is dropped with the region, not before.
    let dropped = Arc::new(AtomicUsize::new(0));
    struct Owner(Arc<AtomicUsize>);
    impl Drop for Owner {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let owned = DeviceMemory {
        addr: 8192,
        len: 64,
        ordinal: 0,
        owner: Some(Box::new(Owner(dropped.clone()))),
        ipc: None,
    };
    // SAFETY: never dereferenced.
    let r2 = unsafe { table.register_device(owned, false) }.unwrap();
    let id = r2.id();
    drop(r2);
    assert_eq!(dropped.load(Ordering::SeqCst), 0, "the table still holds the region");
    table.deregister(id).unwrap();
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
}

fn table() -> RegionTable {
    RegionTable::new(
        format!("kvfabric.test.{}", std::process::id()),
        64,
        ShmSeal::new(b"deployment a"),
        "owner",
    )
}

#[test]
fn owned_region_round_trip_and_bounds() {
    let t = table();
    let r = t.alloc(10_000, RegionOptions::default()).unwrap();
    assert_eq!(r.len(), 10_000);
    r.write_at(9_990, b"0123456789").unwrap();
    let mut out = [0u8; 10];
    r.read_at(9_990, &mut out).unwrap();
    assert_eq!(&out, b"0123456789");
    let len = r.len() as u64;
    assert!(matches!(r.check(len, 1), Err(MemoryError::OutOfBounds { .. })));
    assert!(matches!(r.check(u64::MAX, 2), Err(MemoryError::OutOfBounds { .. })));
    assert!(r.check(len, 0).is_ok());
}

#[test]
fn stale_ids_are_refused_and_leases_block_deregistration() {
    let t = table();
    let r = t.alloc(4096, RegionOptions::default()).unwrap();
    let id = r.id();
    let lease = RegionLease::new(t.get(id).unwrap());
    assert!(matches!(t.deregister(id), Err(MemoryError::RegionBusy { leases: 2, .. })));
    drop(lease);
    assert!(
        matches!(t.deregister(id), Err(MemoryError::RegionBusy { leases: 1, .. })),
        "the handle"
    );
    drop(r);
    t.deregister(id).unwrap();
    assert!(matches!(t.get(id), Err(MemoryError::UnknownRegion(_))));
    // The slot is reused with a new generation: the old id stays dead.
    let r2 = t.alloc(4096, RegionOptions::default()).unwrap();
    assert_ne!(r2.id(), id);
    assert!(t.get(id).is_err());
    assert!(matches!(t.deregister(id), Err(MemoryError::UnknownRegion(_))));
}

/// The pages of this process's mapping at `addr`, in its page tables now (`Rss` of
/// `/proc/self/smaps`), in bytes.
fn resident(addr: usize) -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
        }
        if let Some(kb) = line.strip_prefix("Rss:").filter(|_| inside) {
            return kb.trim().trim_end_matches(" kB").trim().parse::<u64>().unwrap() * 1024;
        }
    }
    panic!("no mapping at {addr:#x}")
}

#[test]
fn a_prefaulted_peer_mapping_is_in_the_page_tables_with_its_bytes_kept() {
    let t = table();
    let len = 16 << 20;
    let r = t.alloc(len, RegionOptions { shared: true, export: true, ..Default::default() });
    let r = r.unwrap();
    r.fill(0, len as u64, 0x5A).unwrap();
    let path = r.shm_path().unwrap().to_path_buf();
    let seal = ShmSeal::new(b"deployment a");
    let peer = PeerMapping::open(&path, len, &seal, "owner", r.id()).unwrap();
    let addr = peer.ptr_at(0, 1).unwrap() as usize;
    assert!(resident(addr) < len as u64 / 2, "a fresh mapping faults pages in on first use");
    peer.prefault();
    assert!(resident(addr) >= len as u64, "all {len} bytes mapped: {}", resident(addr));
    assert_eq!(peer.checksum(0, len as u64), r.checksum(0, len as u64).ok(), "bytes untouched");
}

#[test]
fn shared_region_is_a_memfd_visible_through_a_peer_mapping() {
    let t = table();
    let r =
        t.alloc(8192, RegionOptions { shared: true, export: true, ..Default::default() }).unwrap();
    let path = r.shm_path().unwrap().to_path_buf();
    assert!(path.starts_with(format!("/proc/{}/fd", std::process::id())), "{path:?}");
    let target = std::fs::read_link(&path).unwrap();
    let target = target.to_str().unwrap();
    assert!(target.starts_with("/memfd:kvfabric.test."), "no file in any directory: {target}");
    let seal = ShmSeal::new(b"deployment a");
    let open = |len, owner: &str, region| PeerMapping::open(&path, len, &seal, owner, region);
    let peer = open(8192, "owner", r.id()).unwrap();
    // Paths that are not a process's descriptor, or a descriptor that is not a kvfabric
    // memfd of the named region: out of reach, nothing opened or mapped.
    let file = std::fs::File::open("/etc/passwd").unwrap();
    let passwd = {
        use std::os::fd::AsRawFd;
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), file.as_raw_fd()))
    };
    for foreign in [Path::new("/etc/passwd"), &passwd, Path::new("/proc/self/fd/0")] {
        assert!(
            matches!(
                PeerMapping::open(foreign, 10, &seal, "owner", r.id()),
                Err(MemoryError::Shm { .. })
            ),
            "{foreign:?} refused"
        );
    }
    assert!(matches!(open(8192, "owner", RegionId(r.id().0 + 1)), Err(MemoryError::Shm { .. })));
    // Another deployment's process, another owner: nothing is mapped, the metadata lies.
    let other = ShmSeal::new(b"deployment b");
    assert!(matches!(
        PeerMapping::open(&path, 8192, &other, "owner", r.id()),
        Err(MemoryError::NotSealed { .. })
    ));
    assert!(matches!(open(8192, "someone", r.id()), Err(MemoryError::NotSealed { .. })));
    let src = t.alloc(4096, RegionOptions::default()).unwrap();
    src.write_at(0, b"hello shm").unwrap();
    copy_with_peer(&src, 0, &peer, 100, 9, true).unwrap();
    let mut out = [0u8; 9];
    r.read_at(100, &mut out).unwrap();
    assert_eq!(&out, b"hello shm");
    assert!(copy_with_peer(&src, 0, &peer, 8190, 9, true).is_err());
    assert!(open(1 << 20, "owner", r.id()).is_err(), "longer than the memfd");
    assert!(open(4096, "owner", r.id()).is_err(), "shorter than the region");
    let id = r.id();
    drop(r);
    t.deregister(id).unwrap();
    // The descriptor is closed with the region; the peer's mapping still holds the bytes.
    assert!(std::fs::read_link(&path)
        .map_or(true, |l| !l.to_str().unwrap().contains("memfd:kvfabric.test.")));
    let mut out = [0u8; 9];
    let p = peer.ptr_at(100, 9).unwrap();
    // SAFETY: a checked range of the live mapping.
    out.copy_from_slice(unsafe { std::slice::from_raw_parts(p, 9) });
    assert_eq!(&out, b"hello shm");
}

#[test]
fn external_memory_registers_in_place() {
    let t = table();
    let mut buf = vec![7u8; 1000];
    let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
    // SAFETY: `buf` outlives the registration, which is removed below before it drops.
    let r = unsafe { t.register_external(ptr, buf.len(), false) }.unwrap();
    r.write_at(0, &[1, 2, 3]).unwrap();
    let id = r.id();
    drop(r);
    t.deregister(id).unwrap();
    assert_eq!(&buf[..4], &[1, 2, 3, 7]);
}

#[test]
fn zero_length_and_table_limit() {
    let t = RegionTable::new("kvfabric-test-limit", 1, ShmSeal::new(b"test"), "test");
    assert!(matches!(t.alloc(0, RegionOptions::default()), Err(MemoryError::ZeroLength)));
    let _a = t.alloc(1, RegionOptions::default()).unwrap();
    assert!(matches!(t.alloc(1, RegionOptions::default()), Err(MemoryError::TooManyRegions(1))));
}
