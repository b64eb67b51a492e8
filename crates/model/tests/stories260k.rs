//! End-to-end checks of loading, tokenization and the CPU forward pass against the
//! stories260K golden outputs (transformers float32 greedy; see GOLDEN.md).

mod common;

use baton_model::{load_model_dir, CpuModel, ForwardRow, PagedKvCache, Tokenizer};
use common::{argmax, golden, greedy_alone, model_dir};

fn load() -> (CpuModel, Tokenizer) {
    let m = load_model_dir(model_dir()).expect("stories260K loads");
    let (model, tok) = m.into_cpu_model();
    (model, tok.expect("tokenizer"))
}

#[test]
fn stories260k_loads_with_config_values_and_tied_head() {
    let m = load_model_dir(model_dir()).expect("loads");
    let c = &m.config;
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers),
        (64, 172, 5)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (8, 4, 8)
    );
    assert_eq!((c.vocab_size, c.max_position_embeddings), (512, 512));
    assert!(c.tie_word_embeddings);
    assert_eq!(m.weights.layers.len(), 5);
    assert_eq!(
        m.weights.lm_head, m.weights.embed,
        "tied head reuses embed_tokens"
    );
    assert_eq!(m.weights.layers[0].k_proj.shape, vec![32, 64]);
    assert_eq!(m.eos_token_ids(), vec![2]);
    let tok = m.tokenizer.as_ref().unwrap();
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(1), Some(2)));
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.id_to_piece(378).as_deref(), Some("▁time"));
}

#[test]
fn golden_prompts_encode_to_golden_prompt_ids_with_single_bos() {
    let (_, tok) = load();
    let g = golden();
    for p in &g.prompts {
        assert_eq!(
            tok.encode(&p.prompt, true).unwrap(),
            p.prompt_ids,
            "{:?}",
            p.prompt
        );
        assert_eq!(
            tok.encode(&p.prompt, false).unwrap(),
            p.prompt_ids[1..],
            "{:?}",
            p.prompt
        );
    }
    // The tokenizers-library column of GOLDEN.md's tokenizer table (spaces, bytes, specials).
    for (text, ids) in &g.encode_checks {
        assert_eq!(&tok.encode(text, true).unwrap(), ids, "{text:?}");
    }
}

#[test]
fn first_step_top5_logits_match_golden_within_1e4() {
    let (model, _) = load();
    for p in &golden().prompts {
        let mut kv = PagedKvCache::new(model.config(), 4, 16);
        let logits = model
            .forward(
                &mut kv,
                &[ForwardRow {
                    tokens: &p.prompt_ids,
                    start_pos: 0,
                    block_table: &[0, 1, 2, 3],
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                }],
            )
            .unwrap()
            .remove(0);
        assert_eq!(logits.len(), 512);
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        for (rank, &(id, want)) in p.first_step_top5.iter().enumerate() {
            assert_eq!(order[rank] as u32, id, "{:?} rank {rank}", p.prompt);
            let got = logits[id as usize];
            eprintln!("{:?} id {id}: |diff| {:.2e}", p.prompt, (got - want).abs());
            assert!(
                (got - want).abs() <= 1e-4,
                "{:?} id {id}: got {got}, golden {want}",
                p.prompt
            );
        }
    }
}

#[test]
fn greedy_decode_reproduces_all_64_golden_ids_and_text() {
    let (model, tok) = load();
    let pages: Vec<u32> = (0..8).collect();
    for p in &golden().prompts {
        let (ids, _) = greedy_alone(&model, &p.prompt_ids, 64, 16, &pages, 8);
        assert_eq!(ids, p.greedy_ids, "{:?}", p.prompt);
        let mut all = p.prompt_ids.clone();
        all.extend(&ids);
        let full = tok.decode(&all, true).unwrap();
        let prefix = tok.decode(&p.prompt_ids, true).unwrap();
        assert_eq!(
            full.strip_prefix(prefix.as_str()),
            Some(p.greedy_text.as_str())
        );
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn block_size_and_page_ids_do_not_change_logits_bitwise() {
    let (model, _) = load();
    let p = &golden().prompts[0];
    let n = 24;
    let total = p.prompt_ids.len() + n;
    let mut reference: Option<Vec<Vec<u32>>> = None;
    for bs in [1usize, 16, 32] {
        let blocks = total.div_ceil(bs);
        // Pages in reverse order, offset by 3, in a cache with spare pages.
        let pages: Vec<u32> = (0..blocks).rev().map(|j| (j + 3) as u32).collect();
        let (ids, logits) = greedy_alone(&model, &p.prompt_ids, n, bs, &pages, blocks + 5);
        assert_eq!(ids[..], p.greedy_ids[..n]);
        let b: Vec<Vec<u32>> = logits.iter().map(|l| bits(l)).collect();
        match &reference {
            None => reference = Some(b),
            Some(r) => assert!(r == &b, "block size {bs} changed logits"),
        }
    }
}

/// Sequences decoded together in batches whose membership, row order, prefill chunking and
/// page assignment vary every step must give exactly the logits they give alone.
#[test]
fn mixed_prefill_decode_batches_give_bitwise_identical_logits_to_alone() {
    let (model, _) = load();
    let g = golden();
    const N_NEW: usize = 20;
    let alone: Vec<Vec<Vec<f32>>> = g
        .prompts
        .iter()
        .map(|p| {
            greedy_alone(
                &model,
                &p.prompt_ids,
                N_NEW,
                16,
                &(0..8).collect::<Vec<_>>(),
                8,
            )
            .1
        })
        .collect();

    let bs = 5;
    let per_seq = 32usize.div_ceil(bs);
    let ns = g.prompts.len();
    let mut kv = PagedKvCache::new(model.config(), per_seq * ns, bs);
    // Interleaved, reversed page ids per sequence.
    let tables: Vec<Vec<u32>> = (0..ns)
        .map(|s| (0..per_seq).rev().map(|j| (j * ns + s) as u32).collect())
        .collect();
    let mut known: Vec<Vec<u32>> = g.prompts.iter().map(|p| p.prompt_ids.clone()).collect();
    let mut computed = vec![0usize; ns];
    let mut got: Vec<Vec<Vec<f32>>> = vec![vec![]; ns];
    let mut step = 0usize;
    let mut saw_mixed = false;
    while got.iter().any(|l| l.len() < N_NEW) {
        let mut order: Vec<usize> = (0..ns).collect();
        order.rotate_left(step % ns);
        let mut plan = vec![];
        for &s in &order {
            if got[s].len() >= N_NEW || (step + s) % 4 == 3 {
                continue;
            }
            let remaining = known[s].len() - computed[s];
            let chunk = remaining.min(1 + (step + s) % 3);
            plan.push((s, computed[s], chunk, computed[s] + chunk == known[s].len()));
        }
        let rows: Vec<ForwardRow> = plan
            .iter()
            .map(|&(s, start, len, want)| ForwardRow {
                tokens: &known[s][start..start + len],
                start_pos: start,
                block_table: &tables[s],
                want_logits: want,
                all_logits: false,
                lora: 0,
            })
            .collect();
        if rows.iter().any(|r| r.tokens.len() > 1) && rows.iter().any(|r| r.tokens.len() == 1) {
            saw_mixed = true;
        }
        let mut out = model.forward(&mut kv, &rows).unwrap().into_iter();
        for &(s, _, len, want) in &plan {
            computed[s] += len;
            if want {
                let l = out.next().expect("one logits vector per want_logits row");
                known[s].push(argmax(&l));
                got[s].push(l);
            }
        }
        assert!(out.next().is_none());
        step += 1;
    }
    assert!(saw_mixed, "schedule must mix prefill chunks and decodes");
    for s in 0..ns {
        for (i, (a, b)) in alone[s].iter().zip(&got[s]).enumerate() {
            assert!(
                bits(a) == bits(b),
                "seq {s} step {i}: batched logits differ from alone"
            );
        }
    }
}

/// A forward pass on 1, 2 or 3 threads gives bit-identical logits: big prefill rows (so the
/// linear layers split into row chunks across threads) mixed with decodes.
#[test]
fn thread_count_does_not_change_logits_bitwise() {
    let g = golden();
    let bs = 16;
    let run = |threads: usize| {
        let (mut model, _) = load();
        model.set_threads(threads).unwrap();
        assert_eq!(model.threads(), threads);
        let mut kv = PagedKvCache::new(model.config(), 64, bs);
        // Row r: the golden prompts and greedy ids concatenated, cut to a different length.
        let seqs: Vec<Vec<u32>> = (0..6)
            .map(|r| {
                let p = &g.prompts[r % g.prompts.len()];
                let mut v = p.prompt_ids.clone();
                v.extend_from_slice(&p.greedy_ids);
                v.truncate(40 + 7 * r);
                v
            })
            .collect();
        let tables: Vec<Vec<u32>> = (0..6)
            .map(|r| (0..8).map(|j| (j * 6 + r) as u32).rev().collect())
            .collect();
        let mut logits = vec![];
        // Step 1: prefill everything but the last token (one big batch); step 2: decodes.
        let rows: Vec<ForwardRow> = seqs
            .iter()
            .zip(&tables)
            .map(|(s, t)| ForwardRow {
                tokens: &s[..s.len() - 1],
                start_pos: 0,
                block_table: t,
                want_logits: true,
                all_logits: false,
                lora: 0,
            })
            .collect();
        logits.extend(model.forward(&mut kv, &rows).unwrap());
        let rows: Vec<ForwardRow> = seqs
            .iter()
            .zip(&tables)
            .map(|(s, t)| ForwardRow {
                tokens: &s[s.len() - 1..],
                start_pos: s.len() - 1,
                block_table: t,
                want_logits: true,
                all_logits: false,
                lora: 0,
            })
            .collect();
        logits.extend(model.forward(&mut kv, &rows).unwrap());
        logits.iter().map(|l| bits(l)).collect::<Vec<_>>()
    };
    let one = run(1);
    assert_eq!(one.len(), 12);
    for threads in [2, 3] {
        assert!(run(threads) == one, "{threads} threads changed the logits");
    }
}

#[test]
fn forward_layer_outputs_match_forward_logits() {
    let (model, _) = load();
    let p = &golden().prompts[1];
    let row = |_| ForwardRow {
        tokens: &p.prompt_ids,
        start_pos: 0,
        block_table: &[0],
        want_logits: true,
        all_logits: false,
        lora: 0,
    };
    let mut kv = PagedKvCache::new(model.config(), 1, 16);
    let a = model.forward(&mut kv, &[row(0)]).unwrap();
    let mut kv = PagedKvCache::new(model.config(), 1, 16);
    let (b, layers) = model
        .forward_with_layer_outputs(&mut kv, &[row(0)])
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(layers.len(), 5);
    assert!(layers.iter().all(|l| l.len() == p.prompt_ids.len() * 64));
    assert_ne!(layers[0], layers[4]);
}

/// A row with `all_logits` returns one logits vector per position, each the one that
/// position's prefix gives as its last token alone, bit for bit (prompt log-probabilities
/// rest on this), beside a row that wants only its last token's.
#[test]
fn all_logits_rows_give_every_prefix_its_own_last_token_logits() {
    let (model, _) = load();
    let g = golden();
    let p = &g.prompts[1].prompt_ids;
    let q = &g.prompts[0].prompt_ids;
    let pages: Vec<u32> = (0..4).collect();
    let other: Vec<u32> = (4..8).collect();
    let mut kv = PagedKvCache::new(model.config(), 8, 16);
    let out = model
        .forward(
            &mut kv,
            &[
                ForwardRow {
                    tokens: q,
                    start_pos: 0,
                    block_table: &other,
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                },
                ForwardRow {
                    tokens: p,
                    start_pos: 0,
                    block_table: &pages,
                    want_logits: false,
                    all_logits: true,
                    lora: 0,
                },
            ],
        )
        .unwrap();
    assert_eq!(out.len(), 1 + p.len());
    for k in 1..=p.len() {
        let mut kv = PagedKvCache::new(model.config(), 8, 16);
        let alone = model
            .forward(
                &mut kv,
                &[ForwardRow {
                    tokens: &p[..k],
                    start_pos: 0,
                    block_table: &pages,
                    want_logits: true,
                    all_logits: false,
                    lora: 0,
                }],
            )
            .unwrap();
        assert!(bits(&out[k]) == bits(&alone[0]), "position {}", k - 1);
    }
}
