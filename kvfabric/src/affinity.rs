//! Which CPUs a thread may run on.
//!
//! A thread starts with its creator's CPU affinity. An engine that embeds kvfabric through
//! the C ABI may have pinned the thread that creates kvfabric's runtime to its compute cores
//! (vLLM's CPU backend binds each worker process's threads to the cores it computes on), and
//! kvfabric's threads would then share those cores with a busy compute loop. On a machine
//! running several such engines, kvfabric's transfers waited on the run queue for seconds
//! (a 45 MB shared-memory copy past its 30 s deadline) while other cores were free. So the
//! C ABI's runtime threads widen their affinity to every CPU the process's cpuset allows
//! ([`CpuSet::All`], the default), unless told to keep the inherited one or given a list.

use std::str::FromStr;

/// The CPUs kvfabric's threads run on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum CpuSet {
    /// Every CPU the process's cpuset (cgroup) allows.
    #[default]
    All,
    /// The creating thread's affinity, unchanged.
    Inherit,
    /// These CPUs (within the process's cpuset).
    List(Vec<usize>),
}

/// CPUs above this are refused in a list (the kernel's `CPU_SETSIZE`).
const CPUS_MAX: usize = 1024;

impl FromStr for CpuSet {
    type Err = String;

    /// `all`, `inherit`, or a list such as `0-3,8`.
    fn from_str(s: &str) -> Result<CpuSet, String> {
        match s.trim() {
            "all" => return Ok(CpuSet::All),
            "inherit" => return Ok(CpuSet::Inherit),
            _ => {}
        }
        let mut cpus = Vec::new();
        for part in s.split(',').map(str::trim) {
            let num = |x: &str| {
                x.parse::<usize>()
                    .ok()
                    .filter(|&n| n < CPUS_MAX)
                    .ok_or_else(|| format!("{x:?} is not a CPU number below {CPUS_MAX}"))
            };
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(part)?, num(part)?),
            };
            if a > b {
                return Err(format!("{part:?}: a range goes up"));
            }
            cpus.extend(a..=b);
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(CpuSet::List(cpus))
    }
}

impl CpuSet {
    /// Applies to the calling thread. The kernel keeps the affinity within the process's
    /// cpuset; an error means no CPU of the set is allowed.
    pub fn apply_to_current_thread(&self) -> std::io::Result<()> {
        let cpus: Vec<usize> = match self {
            CpuSet::Inherit => return Ok(()),
            CpuSet::All => (0..CPUS_MAX).collect(),
            CpuSet::List(l) => l.clone(),
        };
        // SAFETY: cpu_set_t is plain bits, zeroed is the empty set; CPU_SET is given numbers
        // below CPU_SETSIZE (CPUS_MAX); sched_setaffinity reads `size_of::<cpu_set_t>()`
        // bytes of the set, which lives on this stack for the call. Pid 0 is this thread.
        let r = unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for cpu in cpus.into_iter().filter(|&c| c < CPUS_MAX) {
                libc::CPU_SET(cpu, &mut set);
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// The calling thread's CPUs.
pub fn current_thread() -> std::io::Result<Vec<usize>> {
    // SAFETY: as above; sched_getaffinity writes at most `size_of::<cpu_set_t>()` bytes into
    // the set, and CPU_ISSET reads numbers below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((0..CPUS_MAX).filter(|&c| libc::CPU_ISSET(c, &set)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse_and_bad_ones_are_refused() {
        assert_eq!("all".parse(), Ok(CpuSet::All));
        assert_eq!(" inherit ".parse(), Ok(CpuSet::Inherit));
        assert_eq!("3, 0-1,1".parse(), Ok(CpuSet::List(vec![0, 1, 3])));
        for bad in ["", "x", "2-1", "0-", "-1", "1024", "0-99999999999999999999"] {
            assert!(bad.parse::<CpuSet>().is_err(), "{bad:?}");
        }
    }

    /// A thread pinned to one CPU widens to all the process may use, and back to a list.
    #[test]
    fn a_pinned_thread_widens_to_every_allowed_cpu() {
        let all = std::thread::spawn(|| {
            CpuSet::All.apply_to_current_thread().unwrap();
            current_thread().unwrap()
        })
        .join()
        .unwrap();
        if all.len() < 2 {
            eprintln!("one CPU allowed here: nothing to widen");
            return;
        }
        let first = all[0];
        let (pinned, widened) = std::thread::spawn(move || {
            CpuSet::List(vec![first]).apply_to_current_thread().unwrap();
            let pinned = current_thread().unwrap();
            // A thread started now inherits the pin, and widens.
            std::thread::spawn(|| {
                let inherited = current_thread().unwrap();
                CpuSet::Inherit.apply_to_current_thread().unwrap();
                assert_eq!(current_thread().unwrap(), inherited);
                CpuSet::All.apply_to_current_thread().unwrap();
                (inherited, current_thread().unwrap())
            })
            .join()
            .map(|(inherited, widened)| {
                assert_eq!(inherited, pinned);
                (pinned, widened)
            })
            .unwrap()
        })
        .join()
        .unwrap();
        assert_eq!(pinned, vec![first]);
        assert_eq!(widened, all);
    }
}
