//! A static check of the programmatic-dependent-launch rule of `kernels/common.cuh`, which
//! neither the emulator (it runs kernels one after another) nor NVRTC can see:
//!
//! - every entry point waits for its predecessor (`BATON_PDL_WAIT()`), in its own body or in a
//!   function it calls;
//! - in every function, each `BATON_PDL_LAUNCH()` comes after a `BATON_PDL_WAIT()` with no other
//!   launch between them. The widened rule (a kernel may read memory written two or more
//!   kernels back before its wait) holds only because no kernel lets its dependents start
//!   before it has itself waited.
//!
//! The scan is textual: comments are stripped, functions are the top-level brace blocks of each
//! file (macro bodies included), and a function's name is the identifier before its parameter
//! list. Good enough for the style of `kernels/`; a kernel written otherwise fails loudly here
//! rather than passing unchecked (an entry point the scan does not find is an error, and so is
//! `griddepcontrol` outside the two macros).
//!
//! What it does not check: order by control flow (a wait under an `if` before an
//! unconditional launch passes), member functions, and the other half of the rule, that
//! nothing before the wait writes global memory or reads what the previous kernel wrote (the
//! attention cp.async prologue and the GEMV's pre-wait loads are checked by review, and by the
//! GPU's results).

use baton_cuda::kernels::{expand_includes, kernel_entry_points, kernel_sources};

const WAIT: &str = "BATON_PDL_WAIT()";
const LAUNCH: &str = "BATON_PDL_LAUNCH()";

/// One top-level function: its name (`##` pastes kept, e.g. `baton_x_hd##D`), whether it is
/// an entry point, and its body text.
struct Function {
    name: String,
    entry: bool,
    body: String,
}

/// `src` without `//` and `/* */` comments (kernels hold no string literals with either), and
/// with the PDL macros' spelling normalized (`BATON_PDL_WAIT ()` -> `BATON_PDL_WAIT()`).
fn strip_comments(src: &str) -> String {
    let mut s = strip_comments_only(src);
    for m in ["BATON_PDL_WAIT", "BATON_PDL_LAUNCH"] {
        loop {
            let spaced = s.match_indices(m).find_map(|(i, _)| {
                let rest = &s[i + m.len()..];
                let gap = rest.len() - rest.trim_start().len();
                (gap > 0 && rest.trim_start().starts_with('(')).then_some((i + m.len(), gap))
            });
            match spaced {
                Some((at, gap)) => s.replace_range(at..at + gap, ""),
                None => break,
            }
        }
    }
    s
}

fn strip_comments_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i += 2;
            while i < b.len() && !b[i..].starts_with(b"*/") {
                i += 1;
            }
            i += 2;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// The identifier (letters, digits, `_`, `#`) that ends right before byte `end` of `s`,
/// skipping whitespace and line continuations.
fn ident_before(s: &str, end: usize) -> Option<String> {
    let b = s.as_bytes();
    let mut e = end;
    while e > 0 && (b[e - 1].is_ascii_whitespace() || b[e - 1] == b'\\') {
        e -= 1;
    }
    let mut st = e;
    while st > 0 && (b[st - 1].is_ascii_alphanumeric() || b[st - 1] == b'_' || b[st - 1] == b'#') {
        st -= 1;
    }
    (st < e).then(|| s[st..e].to_string())
}

/// The top-level functions of one kernel file.
fn functions(src: &str) -> Vec<Function> {
    let s = strip_comments(src);
    let b = s.as_bytes();
    let mut out = Vec::new();
    let (mut depth, mut header_start, mut body_start) = (0usize, 0usize, 0usize);
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'{' => {
                if depth == 0 {
                    body_start = i;
                }
                depth += 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    let header = &s[header_start..body_start];
                    // The parameter list is the header's last top-level parenthesized group.
                    if let Some(close) = header.rfind(')') {
                        let mut d = 0i32;
                        let mut open = None;
                        for (j, ch) in header[..=close].char_indices().rev() {
                            match ch {
                                ')' => d += 1,
                                '(' => {
                                    d -= 1;
                                    if d == 0 {
                                        open = Some(j);
                                        break;
                                    }
                                }
                                _ => {}
                            }
                        }
                        if let Some(name) = open.and_then(|o| ident_before(header, o)) {
                            out.push(Function {
                                name,
                                entry: header.contains("BATON_ENTRY"),
                                body: s[body_start..=i].to_string(),
                            });
                        }
                    }
                    header_start = i + 1;
                }
            }
            b';' if depth == 0 => header_start = i + 1,
            // A preprocessor line ends the header unless continued (a macro body).
            b'\n'
                if depth == 0
                    && s[header_start..i].trim_start().starts_with('#')
                    && !s[..i].trim_end_matches(' ').ends_with('\\') =>
            {
                header_start = i + 1;
            }
            _ => {}
        }
    }
    out
}

/// Whether the occurrence of `name` at byte `i` of `body` is a call: a whole identifier
/// followed by `(` or `<`.
fn call_at(body: &str, i: usize, name: &str) -> bool {
    let before = body[..i].chars().last();
    let after = body[i + name.len()..].trim_start().chars().next();
    !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && matches!(after, Some('(') | Some('<'))
}

/// Whether `body` calls function `name`.
fn calls(body: &str, name: &str) -> bool {
    body.match_indices(name)
        .any(|(i, _)| call_at(body, i, name))
}

/// Every violation of the rule in one file, as readable lines (empty: the file is fine).
fn violations(file: &str, src: &str) -> Vec<String> {
    let fns = functions(src);
    // Functions that wait, directly or through what they call (to a fixed point).
    let mut waits: Vec<bool> = fns.iter().map(|f| f.body.contains(WAIT)).collect();
    loop {
        let mut changed = false;
        for (k, f) in fns.iter().enumerate() {
            if !waits[k]
                && fns
                    .iter()
                    .enumerate()
                    .any(|(j, g)| waits[j] && j != k && calls(&f.body, &g.name))
            {
                waits[k] = true;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let mut bad = Vec::new();
    for (k, f) in fns.iter().enumerate() {
        if f.entry && !waits[k] {
            bad.push(format!(
                "{file}: entry {} never runs BATON_PDL_WAIT",
                f.name
            ));
        }
        // Each launch needs a wait (or a call of a function that waits) since the previous
        // launch or the body's start.
        let mut marks: Vec<(usize, bool)> = f
            .body
            .match_indices(WAIT)
            .map(|(i, _)| (i, true))
            .chain(f.body.match_indices(LAUNCH).map(|(i, _)| (i, false)))
            .collect();
        for (j, g) in fns.iter().enumerate() {
            if waits[j] && j != k {
                marks.extend(
                    f.body
                        .match_indices(g.name.as_str())
                        .filter(|(i, _)| call_at(&f.body, *i, &g.name))
                        .map(|(i, _)| (i, true)),
                );
            }
        }
        marks.sort();
        let mut waited = false;
        for (_, is_wait) in marks {
            if is_wait {
                waited = true;
            } else if !waited {
                bad.push(format!(
                    "{file}: {} runs BATON_PDL_LAUNCH before BATON_PDL_WAIT",
                    f.name
                ));
            } else {
                waited = false;
            }
        }
    }
    bad
}

#[test]
fn every_kernel_waits_before_it_lets_its_dependents_launch() {
    let mut bad = Vec::new();
    for (file, src) in kernel_sources() {
        let src = &expand_includes(file, src);
        bad.extend(violations(file, src));
        if strip_comments(src).contains("griddepcontrol") {
            bad.push(format!(
                "{file}: griddepcontrol outside BATON_PDL_WAIT / BATON_PDL_LAUNCH"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn the_scan_finds_every_entry_point() {
    for (file, src) in kernel_sources() {
        let entries: Vec<String> = functions(&expand_includes(file, src))
            .into_iter()
            .filter(|f| f.entry)
            .map(|f| f.name)
            .collect();
        let (_, expected) = kernel_entry_points()
            .iter()
            .find(|(f, _)| f == file)
            .expect("every source file has its entry list");
        for e in *expected {
            // Macro-made entries appear once with their `##` paste (`..._hd##D`).
            let found = entries.iter().any(|n| {
                n == e
                    || n.split_once("##")
                        .is_some_and(|(stem, _)| e.starts_with(stem))
            });
            assert!(
                found,
                "{file}: entry {e} not found by the scan ({entries:?})"
            );
        }
    }
}

#[test]
fn the_scan_rejects_a_launch_before_the_wait_and_an_entry_that_never_waits() {
    let swapped = "__device__ void body(float* o) {\n    BATON_PDL_LAUNCH();\n    \
                   BATON_PDL_WAIT();\n    o[0] = 1.0f;\n}\n\
                   BATON_ENTRY void k(float* o) { body(o); }\n";
    let v = violations("t.cu", swapped);
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(v[0].contains("body runs BATON_PDL_LAUNCH before"), "{v:?}");

    let second = "BATON_ENTRY void k(float* o) {\n    BATON_PDL_WAIT();\n    \
                  BATON_PDL_LAUNCH();\n    // BATON_PDL_WAIT() in a comment does not count\n    \
                  BATON_PDL_LAUNCH ();\n}\n";
    assert_eq!(violations("t.cu", second).len(), 1);

    let never = "#define E(D) \\\n    BATON_ENTRY void k_hd##D(float* o) { \\\n        \
                 o[0] = 0.0f; \\\n    }\nE(64)\n\
                 __device__ void helper(float* o) { BATON_PDL_WAIT(); o[0] = 1.0f; }\n\
                 BATON_ENTRY void fine(float* o) { helper(o); BATON_PDL_LAUNCH(); }\n";
    let v = violations("t.cu", never);
    assert_eq!(
        v,
        vec!["t.cu: entry k_hd##D never runs BATON_PDL_WAIT".to_string()]
    );
}

/// Whether `body` (a function's `{...}` text) opens with `BATON_TRACE_SCOPE();`, line
/// continuations aside.
fn opens_with_trace_scope(body: &str) -> bool {
    body.trim_start_matches('{')
        .trim_start_matches(|c: char| c.is_whitespace() || c == '\\')
        .starts_with("BATON_TRACE_SCOPE();")
}

/// The launch trace (`BATON_TRACE=1`, kernels/common.cuh) times each launch's last warp
/// leaving through `BATON_TRACE_SCOPE()`, which must open every entry point so that every
/// return path runs its destructor.
#[test]
fn every_entry_point_opens_with_the_trace_scope() {
    let mut bad = Vec::new();
    for (file, src) in kernel_sources() {
        for f in functions(&expand_includes(file, src)) {
            if f.entry && !opens_with_trace_scope(&f.body) {
                bad.push(format!(
                    "{file}: entry {} does not open with BATON_TRACE_SCOPE();",
                    f.name
                ));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(opens_with_trace_scope(
        "{ \\\n    BATON_TRACE_SCOPE(); \\\n x(); }"
    ));
    assert!(!opens_with_trace_scope(
        "{\n    x();\n    BATON_TRACE_SCOPE();\n}"
    ));
}
