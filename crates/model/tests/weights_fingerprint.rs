//! The weights' fingerprint (`baton_model::weights_fingerprint`), which a worker must share
//! with its scheduler: equal for the same tensors however they are stored, different when a
//! tensor's values, dtype or name differ.

mod common;

use baton_model::{dummy_weights_fingerprint, LoadFormat, ModelDir};
use common::{
    fake_dir, model_dir, stories_tensors, write_safetensors, write_two_shards, OwnedTensor,
};

/// The fingerprint of a copy of stories260K holding `tensors` in one file.
fn of(tag: &str, tensors: &[OwnedTensor]) -> u64 {
    let d = fake_dir(tag);
    write_safetensors(&d, "model.safetensors", tensors);
    ModelDir::new(&*d)
        .weights_fingerprint(LoadFormat::Auto)
        .expect("fingerprint")
}

#[test]
fn the_same_tensors_agree_however_they_are_stored() {
    let orig = ModelDir::new(model_dir())
        .weights_fingerprint(LoadFormat::Auto)
        .unwrap();
    let loaded = ModelDir::new(model_dir())
        .load_mapped(LoadFormat::Auto)
        .unwrap();
    assert_eq!(loaded.weights_fingerprint, orig, "load_mapped disagrees");
    let tensors = stories_tensors();
    // Reversed insertion order: safetensors lays the data out differently.
    let mut rev = tensors.clone();
    rev.reverse();
    assert_eq!(of("fp-rev", &rev), orig);
    // Two shards and an index.
    let d = fake_dir("fp-shards");
    write_two_shards(&d, &tensors);
    assert_eq!(
        ModelDir::new(&*d)
            .weights_fingerprint(LoadFormat::Auto)
            .unwrap(),
        orig,
        "sharded copy"
    );
}

#[test]
fn other_values_dtypes_or_names_differ() {
    let tensors = stories_tensors();
    let orig = of("fp-orig", &tensors);
    let big = tensors
        .iter()
        .position(|t| t.3.len() > 3 * 64)
        .expect("a tensor larger than the sampled bytes");
    let with = |i: usize, f: &dyn Fn(&mut OwnedTensor)| {
        let mut t = tensors.clone();
        f(&mut t[i]);
        t
    };
    let cases: Vec<(&str, Vec<OwnedTensor>)> = vec![
        ("first element", with(big, &|t| t.3[0] ^= 1)),
        (
            "last element",
            with(big, &|t| *t.3.last_mut().unwrap() ^= 0x80),
        ),
        (
            "middle element",
            with(big, &|t| {
                let m = t.3.len() / 2;
                t.3[m] ^= 4
            }),
        ),
        ("renamed", with(big, &|t| t.0.push_str(".renamed"))),
        ("reshaped", with(big, &|t| t.2 = vec![t.2.iter().product()])),
        (
            "stored as bf16",
            with(big, &|t| {
                t.1 = safetensors::Dtype::BF16;
                t.3 =
                    t.3.chunks_exact(4)
                        .flat_map(|c| {
                            let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                            half::bf16::from_f32(x).to_le_bytes()
                        })
                        .collect();
            }),
        ),
    ];
    for (what, t) in cases {
        assert_ne!(of("fp-case", &t), orig, "{what}");
    }
    let dummy = ModelDir::new(model_dir())
        .weights_fingerprint(LoadFormat::Dummy { seed: 3 })
        .unwrap();
    assert_eq!(dummy, dummy_weights_fingerprint(3));
    assert_ne!(dummy, orig);
    assert_ne!(dummy, dummy_weights_fingerprint(4));
}
