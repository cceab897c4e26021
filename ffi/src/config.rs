//! `kvf_config`: string keys and values, checked when set, read by `kvf_agent_new` and
//! `kvf_store_new`. One config may serve both: each reads its own keys.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::net::SocketAddr;
use std::str::FromStr;

use crate::error::{guard, kvf_result, FfiError, LastError};
use crate::ptr::{self, Out};

#[derive(Debug, Clone, Copy)]
enum Kind {
    Str,
    Bool,
    U32,
    U64,
    Addr,
    List,
}

/// Every key, its kind, and what it means (the header repeats this list).
const KEYS: &[(&str, Kind, &str)] = &[
    // Agent.
    ("name", Kind::Str, "agent name, unique among peers (default: kvf-<pid>-<random>)"),
    ("secret", Kind::Str, "shared secret of the transfer handshake (required)"),
    ("listen", Kind::Addr, "transfer listen address (default 127.0.0.1:0)"),
    (
        "listen_advertise",
        Kind::Str,
        "the transfer address peers on other hosts dial, HOST or HOST:PORT (default: the listen \
         address, or on 0.0.0.0 the interface that routes to etcd/NATS)",
    ),
    ("shm", Kind::Bool, "offer the shared-memory transport to same-host peers (default true)"),
    ("worker_threads", Kind::U32, "threads of the agent's runtime (default 2)"),
    (
        "cpus",
        Kind::Str,
        "CPUs of the agent's threads: all (default: every CPU the process may use, not the \
         cores an engine pinned its threads to), inherit, or a list such as 2-5,8",
    ),
    ("etcd", Kind::List, "etcd endpoints, comma-separated (default: none, embedded discovery)"),
    ("nats", Kind::Str, "NATS URL (default: none, embedded event bus)"),
    ("namespace", Kind::Str, "namespace of discovery keys and bus subjects (default \"default\")"),
    ("deadline_ms", Kind::U64, "deadline of every transfer and remote call (default 30000)"),
    ("lease_ttl_ms", Kind::U64, "discovery lease of a serving store (default 10000)"),
    (
        "discovery_dir",
        Kind::Str,
        "without etcd: a directory the processes of one host share for discovery (default: none)",
    ),
    // Store.
    ("block_tokens", Kind::U32, "tokens per block (default 16)"),
    ("block_bytes", Kind::U64, "bytes per block (or derive them from `model`)"),
    ("model", Kind::Str, "a model preset, config.json or GGUF file whose block size to use"),
    ("host_blocks", Kind::U32, "host (G2) tier capacity in blocks (default 1024)"),
    (
        "shared_host",
        Kind::Bool,
        "host tier in shared memory (a memfd) for same-host peers (default true)",
    ),
    ("disk_path", Kind::Str, "file of the disk (G3) tier (default: no disk tier)"),
    ("disk_blocks", Kind::U32, "disk tier capacity in blocks (default 4096)"),
    ("disk_admit_min_hits", Kind::U32, "hits before a block is offloaded to disk (default 0)"),
    ("write_through", Kind::Bool, "write every stored block to disk too (default false)"),
    (
        "host_free_target",
        Kind::U32,
        "host slots kept free by evicting in the background, to disk or the fabric (default 0: \
         evict when a slot is needed)",
    ),
    ("lora", Kind::Str, "LoRA adapter name mixed into block hashes (default none)"),
    ("salt", Kind::Str, "cache salt mixed into block hashes (default none)"),
    ("serve", Kind::Bool, "serve this store to peers as a fabric node (default false)"),
    ("advertise", Kind::Bool, "register a serving store in discovery (default true)"),
    ("remote", Kind::Bool, "use fabric nodes as the remote (G4) tier (default false)"),
    ("share", Kind::Bool, "put every stored block to the fabric too (needs remote)"),
];

fn check(key: &str, value: &str) -> Result<(), FfiError> {
    let bad = |what: &str| {
        FfiError::new(
            kvf_result::KVF_INVALID_CONFIG,
            format!("config key {key:?}: {value:?} is not {what}"),
        )
    };
    let Some(&(_, kind, _)) = KEYS.iter().find(|(k, _, _)| *k == key) else {
        let known: Vec<&str> = KEYS.iter().map(|(k, _, _)| *k).collect();
        return Err(FfiError::new(
            kvf_result::KVF_INVALID_CONFIG,
            format!("unknown config key {key:?} (known: {})", known.join(", ")),
        ));
    };
    match kind {
        Kind::Str | Kind::List => Ok(()),
        Kind::Bool => parse_bool(value).map(|_| ()).ok_or_else(|| bad("a boolean")),
        Kind::U32 => {
            value.parse::<u32>().map(|_| ()).map_err(|_| bad("an unsigned 32-bit integer"))
        }
        Kind::U64 => {
            value.parse::<u64>().map(|_| ()).map_err(|_| bad("an unsigned 64-bit integer"))
        }
        Kind::Addr => SocketAddr::from_str(value).map(|_| ()).map_err(|_| bad("a socket address")),
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// Keys whose values are secrets: held as [`kvfabric::secret::Secret`] (never printed,
/// zeroed when the config is freed).
const SECRET_KEYS: [&str; 1] = ["secret"];

/// A configuration under construction. Not thread-safe: build it on one thread.
#[derive(Default)]
pub struct kvf_config {
    values: BTreeMap<String, String>,
    secrets: BTreeMap<String, kvfabric::secret::Secret>,
    last_error: LastError,
}

/// The keys set, and the values that are not secrets.
impl std::fmt::Debug for kvf_config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("kvf_config")
            .field("values", &self.values)
            .field("secrets", &self.secrets)
            .finish_non_exhaustive()
    }
}

impl kvf_config {
    /// A value as set (checked at set time).
    pub(crate) fn str(&self, key: &str) -> Option<&str> {
        match self.secrets.get(key) {
            Some(s) => s.expose_str(),
            None => self.values.get(key).map(String::as_str),
        }
    }

    pub(crate) fn bool(&self, key: &str, default: bool) -> bool {
        self.str(key).and_then(parse_bool).unwrap_or(default)
    }

    pub(crate) fn num<T: FromStr>(&self, key: &str, default: T) -> T {
        self.str(key).and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    pub(crate) fn list(&self, key: &str) -> Vec<String> {
        self.str(key)
            .map(|v| {
                v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
            })
            .unwrap_or_default()
    }

    pub(crate) fn addr(&self, key: &str, default: SocketAddr) -> SocketAddr {
        self.str(key).and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    pub(crate) fn last_error_set(&self, e: &FfiError) {
        self.last_error.set(e);
    }

    /// Sets a key from Rust (tests and benchmarks).
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), FfiError> {
        check(key, value)?;
        if SECRET_KEYS.contains(&key) {
            self.secrets.insert(key.to_string(), value.into());
        } else {
            self.values.insert(key.to_string(), value.to_string());
        }
        Ok(())
    }
}

/// Creates an empty configuration in `*config_out`. Free it with `kvf_config_free`.
///
/// # Safety
/// `config_out` is valid for one write.
#[no_mangle]
pub unsafe extern "C" fn kvf_config_new(config_out: *mut *mut kvf_config) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract on out-parameters.
        let out = unsafe { Out::new(config_out, "config_out") }?;
        out.set(ptr::into_raw(kvf_config::default()));
        Ok(())
    })
}

/// Sets `key` to `value` (both NUL-terminated UTF-8). Unknown keys and values that do not
/// parse fail with `KVF_INVALID_CONFIG` and leave the config as it was.
///
/// # Safety
/// `config` is a live config not used by another thread; `key` and `value` are strings.
#[no_mangle]
pub unsafe extern "C" fn kvf_config_set(
    config: *mut kvf_config,
    key: *const c_char,
    value: *const c_char,
) -> kvf_result {
    // SAFETY: a live config, not used by another thread (the caller's contract).
    let Some(cfg) = (unsafe { config.as_mut() }) else {
        return kvf_result::KVF_NULL_PARAMETER;
    };
    let checked = crate::error::guard_with(|| {
        // SAFETY: strings by the caller's contract.
        let key = unsafe { ptr::cstr(key, "key") }?;
        // SAFETY: as above.
        let value = unsafe { ptr::cstr(value, "value") }?;
        check(key, value)?;
        Ok((key, value))
    });
    let r = checked.map(|(k, v)| {
        if SECRET_KEYS.contains(&k) {
            cfg.secrets.insert(k.to_string(), v.into());
        } else {
            cfg.values.insert(k.to_string(), v.to_string());
        }
    });
    crate::error::code(r, Some(&cfg.last_error))
}

/// Copies the text of the last error of a `kvf_config_*` call on `config` into `buf`
/// (NUL-terminated, truncated to fit) and its length into `*len_out`.
///
/// # Safety
/// `config` is a live config; `buf` is valid for `cap` writes; `len_out` for one.
#[no_mangle]
pub unsafe extern "C" fn kvf_config_last_error(
    config: *const kvf_config,
    buf: *mut c_char,
    cap: usize,
    len_out: *mut usize,
) -> kvf_result {
    guard(|| {
        // SAFETY: the caller's contract.
        let h = unsafe { ptr::handle(config, "config") }?;
        // SAFETY: the caller's contract.
        unsafe { crate::ptr::write_text(&h.last_error.get(), buf, cap, len_out) }
    })
}

/// Frees a config. NULL is allowed.
///
/// # Safety
/// `config` is NULL or a live config, not used again after this call.
#[no_mangle]
pub unsafe extern "C" fn kvf_config_free(config: *mut kvf_config) {
    // SAFETY: the caller gives the handle back once.
    crate::error::guard_void(|| unsafe { ptr::free(config) })
}
