//! Builds the C tests (`tests/c/kvfabric_test.c`) with gcc against the committed header and
//! the cdylib, through the pkg-config file, plain and under AddressSanitizer, and runs them;
//! builds and runs the C++ example (`examples/cpp/kv_pool.cpp`) with g++ the same way.

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
    let crate_dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    );
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
    let src = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("tests/c/kvfabric_test.c");
    let exe = out.join(if asan { "kvfabric_test_asan" } else { "kvfabric_test" });
    let mut flags = vec!["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-g", "-O1"];
    if asan {
        flags.extend(["-fsanitize=address", "-fno-omit-frame-pointer"]);
    }
    compile("gcc", &src, &exe, &flags)
}

/// Compiles `src` into `exe` with `compiler` and `flags`, against the header and the library
/// through pkg-config, with an rpath to the library this test run built.
fn compile(compiler: &str, src: &Path, exe: &Path, flags: &[&str]) -> PathBuf {
    let pc = pkg_config(&pkg_config_dir(exe.parent().expect("a directory")));
    let mut cmd = Command::new(compiler);
    cmd.args(flags).arg(src).arg("-o").arg(exe).args(&pc);
    cmd.arg(format!("-Wl,-rpath,{}", lib_dir().display()));
    let o = cmd.output().unwrap_or_else(|e| panic!("{compiler} runs: {e}"));
    assert!(
        o.status.success(),
        "{compiler} failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    exe.to_path_buf()
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

#[test]
fn the_cpp_example_registers_a_pool_saves_looks_up_and_loads() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    )
    .join("../examples/cpp/kv_pool.cpp");
    let exe = dir.path().join("kv_pool");
    compile("g++", &src, &exe, &["-std=c++17", "-Wall", "-Wextra", "-Werror", "-g", "-O1"]);
    let o = Command::new(&exe).env_remove("LD_LIBRARY_PATH").output().expect("the example runs");
    let text =
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "the C++ example failed ({}):\n{text}", o.status);
    assert!(text.contains("cpp example: ok"), "{text}");
}
