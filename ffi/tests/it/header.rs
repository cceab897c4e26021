//! The committed header is what cbindgen generates from the sources now.

#[test]
fn committed_header_is_current() {
    let dir = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into()),
    );
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let path = dir.join("include/kvfabric.h");
    if std::env::var_os("KVFABRIC_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "ffi/include/kvfabric.h is stale: regenerate it with \
         `KVFABRIC_BLESS=1 cargo test -p kvfabric-ffi --test header` and commit it"
    );
}
