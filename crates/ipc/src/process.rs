//! Process identity and clocks shared across processes: a pid plus its start time names one
//! process even after the pid is reused, and `CLOCK_MONOTONIC` milliseconds are comparable
//! between processes on the same boot (heartbeats).

use std::io;

/// Start time of process `pid`, in clock ticks since boot: field 22 of `/proc/<pid>/stat`.
/// Together with the pid it identifies one process; a reused pid gets a later start time.
pub fn start_time(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat"))?;
    parse_start_time(&stat).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/proc/{pid}/stat: no start time"),
        )
    })
}

/// Field 22 of a `/proc/<pid>/stat` line. The command name (field 2) is in parentheses and may
/// itself contain spaces and parentheses, so fields are counted after the last `)`.
fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(&stat[close + 1..]).ok()?;
    // After ")": field 3 (state) is the first token, so field 22 is token 22 - 3 = 19.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// User plus system CPU time of process `pid` so far, in clock ticks (fields 14 and 15 of
/// `/proc/<pid>/stat`).
pub fn cpu_ticks(pid: u32) -> io::Result<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat"))?;
    let bad = || {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "/proc/<pid>/stat: bad cpu times",
        )
    };
    let close = stat.iter().rposition(|&b| b == b')').ok_or_else(bad)?;
    let rest = std::str::from_utf8(&stat[close + 1..]).map_err(|_| bad())?;
    let mut fields = rest.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    let stime: u64 = fields.next().and_then(|s| s.parse().ok()).ok_or_else(bad)?;
    Ok(utime + stime)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of [`start_time`] and
/// [`cpu_ticks`].
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as u64
    } else {
        100
    }
}

/// Whether `pid` is a live process that started at `start_time` (secondary evidence; the
/// liveness locks are the primary one). A zombie counts as dead.
pub fn is_alive(pid: u32, start_time: u64) -> bool {
    let Ok(stat) = std::fs::read(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let zombie = stat
        .iter()
        .rposition(|&b| b == b')')
        .and_then(|c| stat.get(c + 2))
        .is_some_and(|&s| s == b'Z' || s == b'X');
    !zombie && parse_start_time(&stat) == Some(start_time)
}

/// Milliseconds of `CLOCK_MONOTONIC`: the same clock in every process on this boot, never
/// goes back. The unit of heartbeats. (0 under loom, which has no clock.)
pub fn monotonic_ms() -> u64 {
    #[cfg(loom)]
    {
        0
    }
    #[cfg(not(loom))]
    {
        match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
            Ok(ts) => ts.tv_sec() as u64 * 1000 + ts.tv_nsec() as u64 / 1_000_000,
            Err(_) => 0,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn start_time_parsing_survives_spaces_and_parens_in_the_command_name() {
        let line =
            b"1234 (a b) c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 5 6 0 0 20 0 1 0 987654 1000 10";
        assert_eq!(parse_start_time(line), Some(987654));
        assert_eq!(parse_start_time(b"garbage"), None);
        assert_eq!(parse_start_time(b"1 (x) S 1 2"), None);
    }

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = std::process::id();
        let st = start_time(me).unwrap();
        assert!(st > 0);
        assert!(is_alive(me, st));
        assert!(!is_alive(me, st + 1));
        assert!(cpu_ticks(me).is_ok());
    }

    #[test]
    fn monotonic_ms_does_not_go_back() {
        let a = monotonic_ms();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let b = monotonic_ms();
        assert!(b >= a + 4, "{a} {b}");
    }
}
