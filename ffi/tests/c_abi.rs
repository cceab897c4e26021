//! Builds the C tests (`tests/c/kvfabric_test.c`) with gcc against the committed header and
//! the cdylib, through the pkg-config file, plain and under AddressSanitizer, and runs them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The directory holding the `libkvfabric_ffi.so` that this test run built: `deps/`, beside
/// the test binary (cargo copies it up to `target/<profile>/` only on `cargo build`).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().expect("target/<profile>/deps").to_path_buf();
    assert!(
        dir.join("libkvfabric_ffi.so").exists(),
        "libkvfabric_ffi.so not found in {}",
        dir.display()
    );
    dir
}

/// Writes a pkg-config file for this build into `dir` (from `kvfabric.pc.in`).
fn pkg_config_dir(dir: &Path) -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let template = std::fs::read_to_string(crate_dir.join("kvfabric.pc.in")).unwrap();
    let pc = template
        .replace("@PREFIX@", &crate_dir.display().to_string())
        .replace("@LIBDIR@", &lib_dir().display().to_string())
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    std::fs::write(dir.join("kvfabric.pc"), pc).unwrap();
    dir.to_path_buf()
}

fn pkg_config(pc_dir: &Path) -> Vec<String> {
    let out = Command::new("pkg-config")
        .args(["--cflags", "--libs", "kvfabric"])
        .env("PKG_CONFIG_PATH", pc_dir)
        .output()
        .expect("pkg-config runs (scripts/test.sh installs it)");
    assert!(out.status.success(), "pkg-config: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().split_whitespace().map(String::from).collect()
}

fn build(out: &Path, asan: bool) -> PathBuf {
    let tmp = out.to_path_buf();
    let flags = pkg_config(&pkg_config_dir(&tmp));
    let exe = tmp.join(if asan { "kvfabric_test_asan" } else { "kvfabric_test" });
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/kvfabric_test.c");
    let mut cmd = Command::new("gcc");
    cmd.args(["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-g", "-O1"]);
    if asan {
        cmd.args(["-fsanitize=address", "-fno-omit-frame-pointer"]);
    }
    cmd.arg(&src).arg("-o").arg(&exe).args(&flags);
    cmd.arg(format!("-Wl,-rpath,{}", lib_dir().display()));
    let o = cmd.output().expect("gcc runs");
    assert!(
        o.status.success(),
        "gcc failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    exe
}

fn run(exe: &Path, mode: &str) {
    let o = Command::new(exe)
        .arg(mode)
        // cargo points LD_LIBRARY_PATH at target/<profile>, which may hold an older copy of
        // the library (from `cargo build`); the binary's rpath names the one just built.
        .env_remove("LD_LIBRARY_PATH")
        // Leaks are reported and fail the run; the agent's runtime threads are detached at
        // free, so their thread-locals are not counted.
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:exitcode=23")
        .output()
        .expect("the C test runs");
    let text =
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{} {mode} failed ({}):\n{text}", exe.display(), o.status);
    assert!(text.contains(&format!("{mode}: ok")), "{text}");
}

#[test]
fn c_tests_pass() {
    let dir = tempfile::tempdir().unwrap();
    let exe = build(dir.path(), false);
    run(&exe, "errors");
    run(&exe, "exchange");
}

#[test]
fn c_tests_pass_under_address_sanitizer() {
    let dir = tempfile::tempdir().unwrap();
    let exe = build(dir.path(), true);
    run(&exe, "errors");
    run(&exe, "exchange");
}
