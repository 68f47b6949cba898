//! Kubernetes resource quantities (`resource.Quantity`): the forms pods use for
//! CPU (`500m`, `2`, `0.5`) and memory (`64Mi`, `1G`, `128974848`, `1e9`).

/// A quantity that could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid quantity {0:?}")]
pub struct QuantityError(pub String);

fn split(q: &str) -> (&str, &str) {
    let end = q
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+' || c == '-'))
        .unwrap_or(q.len());
    // An exponent (`1e3`) is part of the number.
    let (num, suffix) = q.split_at(end);
    if let Some(exp) = suffix.strip_prefix(['e', 'E'])
        && !exp.is_empty()
        && exp
            .trim_start_matches(['+', '-'])
            .chars()
            .all(|c| c.is_ascii_digit())
    {
        return (q, "");
    }
    (num, suffix)
}

/// The quantity times 1000 (milli-units), rounded up.
pub fn parse_milli(q: &str) -> Result<i64, QuantityError> {
    scaled(q, 1000.0)
}

/// The quantity in whole units (bytes for memory), rounded up.
pub fn parse_units(q: &str) -> Result<i64, QuantityError> {
    scaled(q, 1.0)
}

/// The quantity times `scale`, rounded up; an error when it does not fit.
fn scaled(q: &str, scale: f64) -> Result<i64, QuantityError> {
    let q = q.trim();
    let err = || QuantityError(q.to_owned());
    let (num, suffix) = split(q);
    let value: f64 = num.parse().map_err(|_| err())?;
    let factor: f64 = match suffix {
        "" => 1.0,
        "m" => 1e-3,
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        "E" => 1e18,
        "Ki" => 1024.0,
        "Mi" => 1024.0f64.powi(2),
        "Gi" => 1024.0f64.powi(3),
        "Ti" => 1024.0f64.powi(4),
        "Pi" => 1024.0f64.powi(5),
        "Ei" => 1024.0f64.powi(6),
        _ => return Err(err()),
    };
    let out = (value * factor * scale).ceil();
    if !out.is_finite() || out < 0.0 || out >= i64::MAX as f64 {
        return Err(err());
    }
    Ok(out as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_and_memory_forms() {
        assert_eq!(parse_milli("500m"), Ok(500));
        assert_eq!(parse_milli("2"), Ok(2000));
        assert_eq!(parse_milli("0.5"), Ok(500));
        assert_eq!(parse_units("64Mi"), Ok(64 << 20));
        assert_eq!(parse_units("1G"), Ok(1_000_000_000));
        assert_eq!(parse_units("1e3"), Ok(1000));
        assert_eq!(parse_units("128974848"), Ok(128_974_848));
        assert_eq!(parse_units("500m"), Ok(1), "rounded up");
        // Too large in milli-units, not in bytes.
        assert_eq!(parse_units("1Ei"), Ok(1 << 60));
        assert!(parse_milli("1Ei").is_err());
        for bad in ["", "abc", "10Xi", "-1", "1..2"] {
            assert!(parse_milli(bad).is_err(), "{bad}");
        }
    }
}
