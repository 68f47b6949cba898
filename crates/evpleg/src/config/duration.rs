//! Durations on the command line in the kubelet's form: Go's
//! `time.ParseDuration` (`--sync-frequency=1m0s`, `--relist-period=300ms`): a
//! sequence of decimal numbers, each with a unit (`ns`, `us`/`µs`, `ms`, `s`,
//! `m`, `h`), such as `1.5s` or `2m30s`. A bare `0` is zero, as in Go; any
//! other number needs its unit, so that `--sync-frequency=60` is refused with a
//! message instead of being read as 60 ns or 60 s by guess.

use std::time::Duration;

/// The longest duration a flag takes (a year), so that adding it to an
/// instant never overflows.
pub const MAX: Duration = Duration::from_secs(365 * 24 * 3600);

/// Parses a Go-style duration; the error names the input and says why.
pub fn parse(s: &str) -> Result<Duration, String> {
    let text = s.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.is_empty() {
        return Err("an empty duration: write a number with a unit, such as 1s or 500ms".into());
    }
    if text.starts_with('-') {
        return Err(format!("{s:?}: a duration cannot be negative"));
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    let mut total = 0f64;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a duration (such as 1s, 500ms or 2m30s)"))?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        let seconds_per_unit = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            "" => {
                return Err(format!(
                    "{s:?}: the number needs a unit (ns, us, ms, s, m or h), such as {number}s"
                ));
            }
            other => {
                return Err(format!(
                    "{s:?}: unknown unit {other:?} (use ns, us, ms, s, m or h)"
                ));
            }
        };
        total += value * seconds_per_unit;
        rest = next;
    }
    if !total.is_finite() || total > MAX.as_secs_f64() {
        return Err(format!("{s:?}: at most a year (8760h)"));
    }
    Ok(Duration::from_secs_f64(total))
}

/// A duration above zero (a period: zero would spin).
pub fn positive(s: &str) -> Result<Duration, String> {
    let d = parse(s)?;
    if d.is_zero() {
        return Err(format!("{s:?}: the period must be more than 0"));
    }
    Ok(d)
}

/// Formats a duration as Go does for round values (`1m0s`, `300ms`, `1.5s`),
/// for help texts and logs.
pub fn format(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns == 0 {
        return "0s".into();
    }
    if ns < 1_000_000_000 {
        return if ns.is_multiple_of(1_000_000) {
            format!("{}ms", ns / 1_000_000)
        } else if ns.is_multiple_of(1_000) {
            format!("{}us", ns / 1_000)
        } else {
            format!("{ns}ns")
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, (secs / 60) % 60, secs % 60);
    let frac = d.subsec_nanos();
    let seconds = if frac == 0 {
        format!("{s}s")
    } else {
        let f = format!("{:.9}", frac as f64 / 1e9);
        format!("{s}{}s", f.trim_start_matches('0').trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        let ok: &[(&str, Duration)] = &[
            ("0", Duration::ZERO),
            ("1s", Duration::from_secs(1)),
            ("300ms", Duration::from_millis(300)),
            ("1.5s", Duration::from_millis(1500)),
            ("1m0s", Duration::from_secs(60)),
            ("2m30s", Duration::from_secs(150)),
            ("1h", Duration::from_secs(3600)),
            ("250us", Duration::from_micros(250)),
            ("250µs", Duration::from_micros(250)),
            ("10ns", Duration::from_nanos(10)),
            (" 5m ", Duration::from_secs(300)),
        ];
        for (text, want) in ok {
            assert_eq!(parse(text).as_ref(), Ok(want), "{text}");
        }
        let bad: &[(&str, &str)] = &[
            ("", "empty"),
            ("60", "needs a unit"),
            ("1.5", "needs a unit"),
            ("-1s", "negative"),
            ("1d", "unknown unit \"d\""),
            ("s", "not a duration"),
            ("1..2s", "not a duration"),
            ("9000h", "at most a year"),
        ];
        for (text, want) in bad {
            let err = parse(text).expect_err(text);
            assert!(err.contains(want), "{text}: {err}");
        }
        assert!(positive("0").unwrap_err().contains("more than 0"));
        assert!(positive("0s").unwrap_err().contains("more than 0"));
    }

    #[test]
    fn formats_as_go_does() {
        for (d, want) in [
            (Duration::ZERO, "0s"),
            (Duration::from_millis(300), "300ms"),
            (Duration::from_secs(1), "1s"),
            (Duration::from_millis(1500), "1.5s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(300), "5m0s"),
            (Duration::from_secs(3725), "1h2m5s"),
        ] {
            assert_eq!(format(d), want);
            assert_eq!(parse(want).unwrap(), d, "{want} parses back");
        }
    }
}
