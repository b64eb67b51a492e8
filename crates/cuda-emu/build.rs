//! Compiles every kernel file in `kernels/` (and the emulator's own test kernels in
//! `csrc/selftest.cu`) as host C++ once per dtype, together with the fiber runtime, into one
//! static library, plus a registry mapping (dtype, entry name) to a type-erased invoker.
//!
//! Per (file, dtype) a wrapper translation unit is generated:
//!
//! ```c++
//! #define BATON_EMU 1
//! #define BATON_DTYPE <d>
//! #include "prelude.h"                       // CUDA surface for the host
//! namespace baton_emu_d<d> { namespace {
//! #include ".../kernels/common.cuh"
//! #include ".../kernels/<file>.cu"
//! } }
//! static const Entry kEntries[] = { BATON_EMU_ENTRY(baton_emu_d<d>::<entry>, "<entry>"), ... };
//! ```
//!
//! The anonymous namespace gives everything internal linkage, so the statics of kernel function
//! templates are plain `.bss` data rather than COMDAT sections; `objcopy` then renames each
//! kernel object's `.bss` (its `__shared__` variables and nothing else) to `baton_emu_shared`,
//! the section the runtime poisons before every block.
//!
//! Entry names are found by preprocessing the same text (with `BATON_EMU` and no prelude, so
//! `__global__` survives) and reading the name after each `__global__ void
//! [__launch_bounds__(...)]`; macro-generated entries are therefore found as well. The C++ is
//! always built with -O2 (emulated kernels are slow enough as it is), never with fast-math and
//! without FP contraction, so host arithmetic is plain IEEE single precision.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const DTYPES: [u32; 3] = [0, 1, 2];

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it"));
    let kernels = manifest
        .join("../../kernels")
        .canonicalize()
        .expect("kernels/ next to crates/");
    let csrc = manifest.join("csrc");
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", csrc.display());
    println!("cargo:rerun-if-env-changed=BATON_EMU_UCONTEXT");
    let common = kernels.join("common.cuh");

    let mut modules: Vec<PathBuf> = std::fs::read_dir(&kernels)
        .expect("read kernels/")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    modules.sort();
    modules.push(csrc.join("selftest.cu"));

    let mut sources = Vec::new();
    let mut tables = Vec::new();
    for module in &modules {
        let stem = module
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("UTF-8 file name");
        for d in DTYPES {
            let entries = scan_entries(&out, &common, module, stem, d);
            assert!(
                !entries.is_empty(),
                "{}: no __global__ entry points",
                module.display()
            );
            let table = format!("baton_emu_table_{stem}_d{d}");
            let path = out.join(format!("emu_{stem}_d{d}.cpp"));
            write_if_changed(&path, &wrapper(&common, module, d, &entries, &table));
            sources.push(path);
            tables.push((d, table));
        }
    }
    let registry = out.join("emu_registry.cpp");
    write_if_changed(&registry, &registry_source(&tables));

    compile(&csrc, &[csrc.join("runtime.cpp"), registry], &sources);
}

fn base_build(csrc: &Path) -> cc::Build {
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++17")
        .opt_level(2)
        .debug(false)
        .include(csrc)
        .flag("-fno-strict-aliasing") // kernels reinterpret elem_t rows as uint4 vectors
        .flag("-ffp-contract=off")
        .flag("-fno-fast-math")
        .flag("-Wno-unknown-pragmas"); // #pragma unroll
                                       // Fibers switch with a few lines of x86-64 assembly; elsewhere, or with
                                       // BATON_EMU_UCONTEXT=1 (to test that path), with swapcontext (slower: a syscall per switch).
    if std::env::var("BATON_EMU_UCONTEXT").is_ok_and(|v| v == "1") {
        b.define("BATON_EMU_UCONTEXT", None);
    }
    b
}

/// Compiles the sources on all cores (the cc crate's own parallelism needs a jobserver
/// dependency), moves the kernels' shared memory into its own section, then archives the objects
/// into one static library.
fn compile(csrc: &Path, runtime: &[PathBuf], kernels: &[PathBuf]) {
    let jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    let work: Vec<(bool, &PathBuf)> = runtime
        .iter()
        .map(|p| (false, p))
        .chain(kernels.iter().map(|p| (true, p)))
        .collect();
    let objects: Vec<(bool, PathBuf)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..jobs)
            .map(|j| {
                let mine: Vec<(bool, &PathBuf)> =
                    work.iter().skip(j).step_by(jobs).copied().collect();
                s.spawn(move || {
                    mine.into_iter()
                        .flat_map(|(kernel, src)| {
                            let mut b = base_build(csrc);
                            if kernel {
                                // Every static of the unit in plain .bss, so one rename moves
                                // them all (-fdata-sections would give each its own section).
                                b.flag("-fno-data-sections");
                            }
                            b.file(src)
                                .compile_intermediates()
                                .into_iter()
                                .map(move |o| (kernel, o))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("compiler thread"))
            .collect()
    });
    let objcopy = std::env::var("OBJCOPY").unwrap_or_else(|_| "objcopy".to_owned());
    println!("cargo:rerun-if-env-changed=OBJCOPY");
    for (kernel, obj) in &objects {
        if !*kernel {
            continue;
        }
        // The kernel units define no variables of their own besides __shared__ ones (entry
        // tables are const and land in .data.rel.ro), so .bss is exactly their shared memory.
        let status = std::process::Command::new(&objcopy)
            .arg("--rename-section")
            .arg(".bss=baton_emu_shared")
            .arg(obj)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {objcopy} (GNU binutils; set OBJCOPY): {e}"));
        assert!(status.success(), "{objcopy} failed on {}", obj.display());
    }
    base_build(csrc)
        .objects(objects.into_iter().map(|(_, o)| o))
        .compile("baton_cuda_emu_native");
}

fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        std::fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }
}

/// Entry names of `module` for dtype `d`, in source order.
fn scan_entries(out: &Path, common: &Path, module: &Path, stem: &str, d: u32) -> Vec<String> {
    let scan = out.join(format!("scan_{stem}_d{d}.cpp"));
    write_if_changed(
        &scan,
        &format!(
            "#define BATON_EMU 1\n#define BATON_DTYPE {d}\n#include \"{}\"\n#include \"{}\"\n",
            common.display(),
            module.display()
        ),
    );
    let text = cc::Build::new().cpp(true).file(&scan).expand();
    let text = String::from_utf8_lossy(&text);
    parse_entries(&text).unwrap_or_else(|e| panic!("{}: {e}", module.display()))
}

fn parse_entries(text: &str) -> Result<Vec<String>, String> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("__global__") {
        let before_ok = rest[..at].chars().next_back().is_none_or(|c| !is_ident(c));
        rest = &rest[at + "__global__".len()..];
        if !before_ok || rest.starts_with(is_ident) {
            continue;
        }
        let r = rest.trim_start();
        let r = r
            .strip_prefix("void")
            .filter(|r| !r.starts_with(is_ident))
            .ok_or_else(|| format!("__global__ not followed by void: {:.80}", r))?
            .trim_start();
        let r = match r.strip_prefix("__launch_bounds__") {
            Some(lb) => {
                let lb = lb.trim_start();
                let mut depth = 0usize;
                let mut end = None;
                for (i, c) in lb.char_indices() {
                    match c {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                end = Some(i + 1);
                                break;
                            }
                        }
                        _ if depth == 0 => return Err("__launch_bounds__ without (".into()),
                        _ => {}
                    }
                }
                lb[end.ok_or("unbalanced __launch_bounds__")?..].trim_start()
            }
            None => r,
        };
        let len = r.find(|c: char| !is_ident(c)).unwrap_or(r.len());
        let name = &r[..len];
        if name.is_empty() || !r[len..].trim_start().starts_with('(') {
            return Err(format!("cannot read the entry name in: {:.80}", r));
        }
        names.push(name.to_owned());
    }
    Ok(names)
}

fn wrapper(common: &Path, module: &Path, d: u32, entries: &[String], table: &str) -> String {
    let mut s = format!(
        "// Generated by crates/cuda-emu/build.rs: {} for BATON_DTYPE {d}.\n\
         #define BATON_EMU 1\n#define BATON_DTYPE {d}\n\
         #include \"prelude.h\"\n#include \"runtime.h\"\n\
         namespace baton_emu_d{d} {{\nnamespace {{\n#include \"{}\"\n#include \"{}\"\n}}\n}}  // namespace baton_emu_d{d}\n\
         static const ::baton_emu::Entry kEntries[] = {{\n",
        module.display(),
        common.display(),
        module.display()
    );
    for e in entries {
        writeln!(s, "    BATON_EMU_ENTRY(baton_emu_d{d}::{e}, \"{e}\"),").unwrap();
    }
    write!(
        s,
        "}};\nextern \"C\" const ::baton_emu::Entry* {table}(size_t* n) {{\n    \
         *n = sizeof kEntries / sizeof kEntries[0];\n    return kEntries;\n}}\n"
    )
    .unwrap();
    s
}

fn registry_source(tables: &[(u32, String)]) -> String {
    let mut s = String::from(
        "// Generated by crates/cuda-emu/build.rs: every (dtype, entry) the emulator can run.\n\
         #include \"runtime.h\"\n",
    );
    for (_, t) in tables {
        writeln!(s, "extern \"C\" const ::baton_emu::Entry* {t}(size_t* n);").unwrap();
    }
    s.push_str(
        "namespace {\nstruct Table {\n    int dtype;\n    \
         const ::baton_emu::Entry* (*get)(size_t*);\n};\nconst Table kTables[] = {\n",
    );
    for (d, t) in tables {
        writeln!(s, "    {{{d}, &{t}}},").unwrap();
    }
    s.push_str(
        r#"};
}  // namespace

// The i-th entry of dtype module `dtype` (in file, then source order), or null past the end.
extern "C" const ::baton_emu::Entry* baton_emu_entry_at(int dtype, size_t i) {
    for (const Table& t : kTables) {
        if (t.dtype != dtype) continue;
        size_t n = 0;
        const ::baton_emu::Entry* e = t.get(&n);
        if (i < n) return e + i;
        i -= n;
    }
    return nullptr;
}

extern "C" const char* baton_emu_entry_name(const ::baton_emu::Entry* e) { return e->name; }
extern "C" unsigned baton_emu_entry_params(const ::baton_emu::Entry* e) { return e->num_params; }
"#,
    );
    s
}
