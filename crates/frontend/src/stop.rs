//! Stop strings with hold-back.
//!
//! Contract: text passes through [`StopMatcher::push`] in the order it was generated. Text that
//! could still be the start of a stop string is held back until it is ruled out; a stop string
//! is found wherever it lies, including across pushes (tokens), and the output is cut where the
//! earliest match begins (or after it, with `include_stop`); the stop string that matched is
//! reported (vLLM's `stop_reason`). [`StopMatcher::flush`] releases the held-back text when
//! generation ends for another reason.

use aho_corasick::{AhoCorasick, AhoCorasickKind};

/// The result of one push.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text released now.
    pub text: String,
    /// The stop string that matched, as the request gave it: nothing follows.
    pub matched: Option<String>,
}

impl StopOutput {
    /// True when a stop string matched.
    pub fn stopped(&self) -> bool {
        self.matched.is_some()
    }
}

/// Stop-string matcher of one sequence.
///
/// Cost per push: one Aho-Corasick pass over the held-back text and the new text (whatever
/// the number of stop strings), and a binary search of the sorted stop strings per held-back
/// candidate suffix; the held-back text is shorter than the longest stop string.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// `stops`, sorted and deduplicated (for the held-back suffix's prefix test).
    sorted: Vec<String>,
    /// An automaton over `stops` (pattern `i` is `stops[i]`); `None` when there are none.
    automaton: Option<AhoCorasick>,
    /// The longest stop string's length in bytes.
    longest: usize,
    include_stop: bool,
    pending: String,
    /// Bytes at the start of `pending` that came from [`StopMatcher::pass`]: a match must end
    /// after them (vLLM checks stop strings only once `min_tokens` outputs exist, but a match
    /// may begin in the text before).
    floor: usize,
    /// The stop string that matched; nothing is released after it.
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored). With `include_stop` the matched stop
    /// string is part of the output.
    pub fn new(stops: &[String], include_stop: bool) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let mut sorted = stops.clone();
        sorted.sort_unstable();
        sorted.dedup();
        // Standard semantics: every occurrence of every pattern, for the overlapping search.
        // Building fails only past the crate's size limits, far beyond what a request may
        // give (`validate::MAX_STOP_BYTES`); without an automaton the search below still
        // runs, per stop string.
        let automaton = (!stops.is_empty())
            .then(|| {
                AhoCorasick::builder()
                    .kind(Some(AhoCorasickKind::ContiguousNFA))
                    .build(&stops)
                    .ok()
            })
            .flatten();
        Self {
            longest: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            sorted,
            automaton,
            include_stop,
            pending: String::new(),
            floor: 0,
            matched: None,
        }
    }

    /// True when there are no stop strings.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds `text`; returns what can be released and whether a stop string matched.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.matched.is_some() {
            return StopOutput {
                text: String::new(),
                matched: self.matched.clone(),
            };
        }
        if self.stops.is_empty() {
            return StopOutput {
                text: text.to_owned(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        // Earliest full match ending after `floor` (ties: the longest stop string).
        let best = self.earliest_match();
        if let Some((at, i)) = best {
            let stop = &self.stops[i];
            let end = if self.include_stop {
                at + stop.len()
            } else {
                at
            };
            let out = self.pending[..end].to_owned();
            self.matched = Some(stop.clone());
            self.pending.clear();
            self.floor = 0;
            return StopOutput {
                text: out,
                matched: self.matched.clone(),
            };
        }
        StopOutput {
            text: self.release(),
            matched: None,
        }
    }

    /// The earliest match in `pending` that ends after `floor` (ties: the longest stop
    /// string): its start and its index in `stops`.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        let better = |best: Option<(usize, usize)>, at: usize, i: usize| match best {
            None => true,
            Some((b, j)) => at < b || (at == b && self.stops[i].len() > self.stops[j].len()),
        };
        let mut best = None;
        let Some(ac) = &self.automaton else {
            // Every occurrence of each stop string, overlapping ones included.
            for (i, s) in self.stops.iter().enumerate() {
                let mut from = 0;
                while let Some(p) = self.pending[from..].find(s.as_str()) {
                    let at = from + p;
                    if at + s.len() > self.floor {
                        if better(best, at, i) {
                            best = Some((at, i));
                        }
                        break;
                    }
                    from = at + s.chars().next().map_or(1, char::len_utf8);
                }
            }
            return best;
        };
        // Matches come in the order of their ends; one ending more than `longest` bytes past
        // the best start starts after it, and so do all later ones.
        for m in ac.find_overlapping_iter(self.pending.as_str()) {
            if best.is_some_and(|(b, _)| m.end() > b + self.longest) {
                break;
            }
            let i = m.pattern().as_usize();
            if m.end() > self.floor && better(best, m.start(), i) {
                best = Some((m.start(), i));
            }
        }
        best
    }

    /// Releases `pending` but its longest suffix that is a proper prefix of some stop string.
    fn release(&mut self) -> String {
        // A proper prefix of a stop string is shorter than the longest one.
        let from = self
            .pending
            .len()
            .saturating_sub(self.longest.saturating_sub(1));
        let cut = (from..self.pending.len())
            .filter(|&i| self.pending.is_char_boundary(i))
            .find(|&i| {
                // The first stop string above `tail` starts with it if any longer one does
                // (those that do follow `tail` itself in sorted order).
                let tail = &self.pending[i..];
                let k = self.sorted.partition_point(|s| s.as_str() <= tail);
                self.sorted.get(k).is_some_and(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        self.floor = self.floor.saturating_sub(cut);
        self.pending.drain(..cut).collect()
    }

    /// Feeds `text` without looking for stop strings ending in it (the text of the first
    /// `min_tokens` outputs, as vLLM). Its tail that could begin a stop string is still held
    /// back, so a match that begins in it and ends in a later push is found, as in vLLM.
    /// Nothing is released after a match.
    pub fn pass(&mut self, text: &str) -> StopOutput {
        if self.matched.is_some() {
            return StopOutput {
                text: String::new(),
                matched: self.matched.clone(),
            };
        }
        if self.stops.is_empty() {
            return StopOutput {
                text: text.to_owned(),
                matched: None,
            };
        }
        self.pending.push_str(text);
        self.floor = self.pending.len();
        StopOutput {
            text: self.release(),
            matched: None,
        }
    }

    /// Releases the held-back text (generation ended for another reason).
    pub fn flush(&mut self) -> String {
        if self.matched.is_some() {
            return String::new();
        }
        self.floor = 0;
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(
            &stops.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            false,
        )
    }

    #[test]
    fn stop_spanning_pushes_is_found_and_cut_where_it_begins() {
        let mut s = m(&["the end"]);
        assert_eq!(s.push("once th").text, "once ");
        assert_eq!(s.push("e e").text, "");
        let o = s.push("nd. more");
        assert_eq!(o.matched.as_deref(), Some("the end"));
        assert_eq!(o.text, "");
        let after = s.push("x");
        assert_eq!(after.text, "");
        assert!(after.stopped());
    }

    #[test]
    fn held_back_text_is_released_when_ruled_out() {
        let mut s = m(&["abc"]);
        assert_eq!(s.push("xab").text, "x");
        assert_eq!(s.push("d").text, "abd");
    }

    #[test]
    fn held_back_text_is_flushed_at_the_end() {
        let mut s = m(&["abc"]);
        assert_eq!(s.push("xa").text, "x");
        assert_eq!(s.flush(), "a");
    }

    #[test]
    fn earliest_match_wins_and_include_stop_keeps_it() {
        let mut s = StopMatcher::new(&["cd".into(), "b".into()], true);
        let o = s.push("abcd");
        assert_eq!(o.matched.as_deref(), Some("b"));
        assert_eq!(o.text, "ab");
        // At one position the longest stop string is the one reported.
        let mut s = m(&["ab", "abc", "b"]);
        assert_eq!(s.push("xabcd").matched.as_deref(), Some("abc"));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let mut s = m(&["é!"]);
        assert_eq!(s.push("café").text, "caf");
        let o = s.push("!");
        assert_eq!(o.matched.as_deref(), Some("é!"));
        assert_eq!(o.text, "");
    }

    #[test]
    fn a_match_beginning_in_passed_text_and_ending_after_it_is_found() {
        // vLLM: stop strings are checked from the first output past min_tokens, over a window
        // reaching back into the text before it.
        let mut s = m(&["the end"]);
        assert_eq!(s.pass("once the e").text, "once ");
        let o = s.push("nd. more");
        assert_eq!(o.matched.as_deref(), Some("the end"));
        assert_eq!(o.text, "");
        // With include_stop the held-back part comes out with the stop string.
        let mut s = StopMatcher::new(&["the end".into()], true);
        assert_eq!(s.pass("once the e").text, "once ");
        assert_eq!(s.push("nd. more").text, "the end");
    }

    #[test]
    fn a_match_ending_in_passed_text_is_not_found_even_when_held_back() {
        let mut s = m(&["ab", "xaby"]);
        // "xab" is held back (it could begin "xaby") but its "ab" ended in passed text.
        assert_eq!(s.pass("xab").text, "");
        let o = s.push("z");
        assert!(!o.stopped());
        assert_eq!(o.text, "xabz");
        // Past the passed text, "ab" matches again.
        assert_eq!(s.push("ab").matched.as_deref(), Some("ab"));
        // A whole stop string inside passed text is released, not matched.
        let mut s = m(&["end"]);
        assert_eq!(s.pass("the end is").text, "the end is");
        assert!(!s.push(" near").stopped());
    }

    #[test]
    fn pass_without_stops_and_after_a_match() {
        let mut s = m(&[]);
        assert_eq!(s.pass("abc").text, "abc");
        let mut s = m(&["x"]);
        assert!(s.push("x").stopped());
        let o = s.pass("more");
        assert_eq!(o.text, "");
        assert!(o.stopped());
    }

    #[test]
    fn no_stops_passes_through() {
        let mut s = m(&[""]);
        assert!(s.is_empty());
        assert_eq!(s.push("abc").text, "abc");
    }

    #[test]
    fn a_match_overlapping_passed_text_is_found_where_it_ends_after_it() {
        // "aa" at 0 lies in the passed text; the one at 1 ends after it.
        // (A whole stop string in passed text is released: only its proper prefixes may
        // begin a match.)
        let mut s = m(&["aa"]);
        assert_eq!(s.pass("xaa").text, "xa");
        let o = s.push("a");
        assert_eq!(o.matched.as_deref(), Some("aa"));
        assert_eq!(o.text, "");
        // "aab" holds the passed "aa" back whole; of "aaa", "aa" at 0 lies in the passed
        // text and "aa" at 1 ends after it. Both searches.
        for automaton in [true, false] {
            let mut s = m(&["aa", "aab"]);
            if !automaton {
                s.automaton = None;
            }
            assert_eq!(s.pass("aa").text, "");
            let o = s.push("a");
            assert_eq!(o.matched.as_deref(), Some("aa"), "automaton {automaton}");
            assert_eq!(o.text, "a");
        }
    }

    /// The contract, computed from the whole text so far: the first push after which some
    /// occurrence of a stop string lies in the text (after the passed part) stops at the
    /// earliest such occurrence (ties: the longest string); until then everything but the
    /// longest suffix that is a proper prefix of a stop string has been released.
    fn reference(stops: &[String], passed: &str, pieces: &[String], include: bool) -> String {
        let mut all = passed.to_owned();
        let mut log = String::new();
        for p in pieces {
            all.push_str(p);
            let mut best: Option<(usize, &String)> = None;
            for s in stops.iter().filter(|s| !s.is_empty()) {
                for at in (0..=all.len().saturating_sub(s.len()))
                    .filter(|&a| all[a..].starts_with(s.as_str()))
                {
                    let later =
                        best.is_some_and(|(b, bs)| at > b || (at == b && s.len() <= bs.len()));
                    if at + s.len() > passed.len() && !later {
                        best = Some((at, s));
                    }
                }
            }
            if let Some((at, s)) = best {
                let end = if include { at + s.len() } else { at };
                log.push_str(&format!("[{}|{s}]", &all[..end]));
                return log;
            }
            let held = (0..=all.len())
                .find(|&i| {
                    stops
                        .iter()
                        .any(|s| s.len() > all.len() - i && s.starts_with(&all[i..]))
                })
                .unwrap_or(all.len());
            log.push_str(&format!("<{}>", &all[..held]));
        }
        log + &format!("({all})")
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn streamed_pieces_follow_the_contract(
            stops in proptest::collection::vec("[abc]{0,4}", 1..5),
            passed in "[abc]{0,4}",
            pieces in proptest::collection::vec("[abc]{0,3}", 0..10),
            include: bool,
        ) {
            // The automaton's search, and the per-string search kept for a set of stop
            // strings it cannot be built for.
            let mut per_string = StopMatcher::new(&stops, include);
            per_string.automaton = None;
            for mut s in [StopMatcher::new(&stops, include), per_string] {
                let mut released = s.pass(&passed).text;
                let mut log = String::new();
                let mut all = passed.clone();
                for p in &pieces {
                    all.push_str(p);
                    let o = s.push(p);
                    released.push_str(&o.text);
                    if let Some(stop) = o.matched {
                        log.push_str(&format!("[{released}|{stop}]"));
                        break;
                    }
                    log.push_str(&format!("<{released}>"));
                }
                if !log.ends_with(']') {
                    released.push_str(&s.flush());
                    log.push_str(&format!("({released})"));
                    proptest::prop_assert_eq!(&released, &all);
                }
                proptest::prop_assert_eq!(log, reference(&stops, &passed, &pieces, include));
            }
        }
    }
}
