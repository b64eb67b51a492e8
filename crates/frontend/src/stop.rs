//! Stop strings with hold-back.
//!
//! Contract: text passes through [`StopMatcher::push`] in the order it was generated. Text that
//! could still be the start of a stop string is held back until it is ruled out; a stop string
//! is found wherever it lies, including across pushes (tokens), and the output is cut where the
//! earliest match begins (or after it, with `include_stop`). [`StopMatcher::flush`] releases the
//! held-back text when generation ends for another reason.

/// The result of one push.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text released now.
    pub text: String,
    /// True when a stop string matched: nothing follows.
    pub stopped: bool,
}

/// Stop-string matcher of one sequence.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    include_stop: bool,
    pending: String,
    done: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored). With `include_stop` the matched stop
    /// string is part of the output.
    pub fn new(stops: &[String], include_stop: bool) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            include_stop,
            pending: String::new(),
            done: false,
        }
    }

    /// True when there are no stop strings.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds `text`; returns what can be released and whether a stop string matched.
    pub fn push(&mut self, text: &str) -> StopOutput {
        if self.done {
            return StopOutput {
                text: String::new(),
                stopped: true,
            };
        }
        if self.stops.is_empty() {
            return StopOutput {
                text: text.to_owned(),
                stopped: false,
            };
        }
        self.pending.push_str(text);
        // Earliest full match (ties: the longest stop string).
        let mut best: Option<(usize, usize)> = None;
        for s in &self.stops {
            if let Some(at) = self.pending.find(s.as_str()) {
                let better = match best {
                    None => true,
                    Some((b, len)) => at < b || (at == b && s.len() > len),
                };
                if better {
                    best = Some((at, s.len()));
                }
            }
        }
        if let Some((at, len)) = best {
            let end = if self.include_stop { at + len } else { at };
            let out = self.pending[..end].to_owned();
            self.pending.clear();
            self.done = true;
            return StopOutput {
                text: out,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let cut = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let out: String = self.pending.drain(..cut).collect();
        StopOutput {
            text: out,
            stopped: false,
        }
    }

    /// Releases the held-back text (generation ended for another reason).
    pub fn flush(&mut self) -> String {
        if self.done {
            return String::new();
        }
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
        assert!(o.stopped);
        assert_eq!(o.text, "");
        assert_eq!(s.push("x").text, "");
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
        assert!(o.stopped);
        assert_eq!(o.text, "ab");
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let mut s = m(&["é!"]);
        assert_eq!(s.push("café").text, "caf");
        let o = s.push("!");
        assert!(o.stopped);
        assert_eq!(o.text, "");
    }

    #[test]
    fn no_stops_passes_through() {
        let mut s = m(&[""]);
        assert!(s.is_empty());
        assert_eq!(s.push("abc").text, "abc");
    }
}
