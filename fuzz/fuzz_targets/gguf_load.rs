//! Any file given as `--model FILE.gguf` must load or fail with an error: never a panic, an
//! abort or an allocation far past the file's size. This target runs the loading path a
//! worker and a frontend take for a GGUF file: `gguf::prepare_dir` (header, metadata as
//! config.json, the tokenizer's conversion, the generation config), then the model
//! directory's load (config, mapped weights, tokenizer), the CPU model's build with 8-bit
//! activations on and off, one prefill and one decode step, and a tokenizer round trip.
#![no_main]

use baton_model::{gguf, CpuModel, ForwardRow, LoadFormat, ModelDir, ModelWeights, PagedKvCache};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let root = std::env::temp_dir().join(format!("baton-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&root).expect("the fuzzer's scratch directory");
    let file = root.join("in.gguf");
    std::fs::write(&file, data).expect("the fuzzer's input file");
    let Ok(prepared) = gguf::prepare_dir(&file, &root.join("cache")) else {
        return;
    };
    let dir = ModelDir::new(&prepared.dir);
    let Ok(m) = dir.load_mapped_lenient(LoadFormat::Auto) else {
        return;
    };
    if let Some(tok) = &m.tokenizer {
        if let Ok(ids) = tok.encode("Once upon a time", true) {
            let _ = tok.decode(&ids, false);
        }
    }
    let cfg = m.config.clone();
    let ModelWeights::Mapped(src) = &m.weights else {
        return;
    };
    let Ok(mut model) = CpuModel::from_source(cfg.clone(), src) else {
        return;
    };
    let _ = model.set_threads(1);
    for int8 in [true, false] {
        model.set_int8_activations(int8);
        let Ok(mut kv) = PagedKvCache::try_new(&cfg, 2, 16) else {
            return;
        };
        let vocab = cfg.vocab_size.max(1) as u32;
        let prompt: Vec<u32> = (0..3).map(|i| (i * 7 + 1) % vocab).collect();
        let table = [0u32, 1];
        let row = |tokens, start_pos| ForwardRow {
            tokens,
            start_pos,
            block_table: &table,
            want_logits: true,
            all_logits: false,
            lora: 0,
        };
        if model.forward(&mut kv, &[row(&prompt, 0)]).is_ok() {
            let _ = model.forward(&mut kv, &[row(&prompt[..1], prompt.len())]);
        }
    }
});
