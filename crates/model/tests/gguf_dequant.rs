//! `GgmlType::dequantize` against an independent implementation: llama.cpp's Python package
//! gguf-py (`gguf.quants.dequantize`, numpy ports of ggml's `dequantize_row_*`). The fixture,
//! `tests/fixtures/gguf-dequant.json`, holds a few blocks of seeded random bytes per type and
//! gguf-py's values for them; `scripts/gguf-dequant-fixture.py` writes it (its header says how).
//!
//! The comparison is exact, bit for bit (the sign of zero included): gguf-py performs the same f32
//! operations in the same order as ggml's scalar C and as Baton (`d·sc` then `·q`, then `− dmin·m`
//! as a separate, rounded subtraction; numpy never fuses a multiply-add), so no tolerance is
//! needed, and any formula slip (a wrong bit, shift, offset or scale) changes some value.

use baton_model::gguf_quant::GgmlType;
use serde_json::Value;

fn fixture() -> serde_json::Map<String, Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gguf-dequant.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    match serde_json::from_str(&text).unwrap() {
        Value::Object(m) => m,
        v => panic!("{path}: not an object: {v}"),
    }
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn dequantize_matches_gguf_py() {
    let fixture = fixture();
    let mut names: Vec<&str> = fixture.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut want_names: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
    want_names.sort_unstable();
    assert_eq!(names, want_names, "the fixture covers every type read");

    for t in GgmlType::ALL {
        let entry = &fixture[t.name()];
        let bytes = unhex(entry["bytes_hex"].as_str().unwrap());
        // Each JSON number is an f32 written exactly (as the f64 of the same value; `-0.0` for
        // negative zero, which serde_json reads back as −0).
        let want: Vec<f32> = entry["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert!(want.len().is_multiple_of(t.block_size()), "{}", t.name());
        assert!(
            want.len() >= 2 * t.block_size(),
            "{}: at least 2 blocks",
            t.name()
        );

        for par in [false, true] {
            let mut got = vec![f32::NAN; want.len()];
            if par {
                t.dequantize_par(&bytes, &mut got).unwrap();
            } else {
                t.dequantize(&bytes, &mut got).unwrap();
            }
            let bad: Vec<String> = got
                .iter()
                .zip(&want)
                .enumerate()
                .filter(|(_, (g, w))| g.to_bits() != w.to_bits())
                .map(|(i, (g, w))| format!("[{i}] got {g:e} want {w:e}"))
                .collect();
            assert!(
                bad.is_empty(),
                "{} (par={par}): {} of {} values differ from gguf-py: {}",
                t.name(),
                bad.len(),
                want.len(),
                bad.iter().take(8).cloned().collect::<Vec<_>>().join(", ")
            );
        }
    }
}

#[test]
fn fixture_lengths_are_checked() {
    // A fixture's bytes with one byte more or less, or one element too many, are refused.
    let fixture = fixture();
    for t in GgmlType::ALL {
        let bytes = unhex(fixture[t.name()]["bytes_hex"].as_str().unwrap());
        let n = bytes.len() / t.type_size() * t.block_size();
        let mut out = vec![0f32; n];
        assert!(t.dequantize(&bytes[1..], &mut out).is_err(), "{}", t.name());
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(t.dequantize(&longer, &mut out).is_err(), "{}", t.name());
        let mut out = vec![0f32; n + 1];
        assert!(t.dequantize(&bytes, &mut out).is_err(), "{}", t.name());
    }
}
