//! Stop strings with hold-back.
//!
//! Contract: text passes through [`StopMatcher::push`] in the order it was generated. Text that
//! could still be the start of a stop string is held back until it is ruled out; a stop string
//! is found wherever it lies, including across pushes (tokens), and the output is cut where the
//! earliest match begins (or after it, with `include_stop`); the stop string that matched is
//! reported (vLLM's `stop_reason`). [`StopMatcher::flush`] releases the held-back text when
//! generation ends for another reason.

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
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
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
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
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
        let mut best: Option<(usize, &String)> = None;
        for s in &self.stops {
            let first = self
                .pending
                .match_indices(s.as_str())
                .map(|(at, _)| at)
                .find(|&at| at + s.len() > self.floor);
            if let Some(at) = first {
                let better = match best {
                    None => true,
                    Some((b, bs)) => at < b || (at == b && s.len() > bs.len()),
                };
                if better {
                    best = Some((at, s));
                }
            }
        }
        if let Some((at, stop)) = best {
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

    /// Releases `pending` but its longest suffix that is a proper prefix of some stop string.
    fn release(&mut self) -> String {
        let cut = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
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
}
