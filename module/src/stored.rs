//! The values the module reads and writes, exactly as `scripts.lua` stores them
//! (docs/design.md §6): a fleet may run either on the same keys.
//!
//! A bucket is the string `"B L"`, `"B L H"` or `"B L H C X"`: its balance `B`
//! in units, the microsecond `L` it was last refilled to, its headroom `H`
//! (absent, or -1 in the five-field form: no constraint but the cap), and with
//! leases out their units `C` and the earliest expiry `X` of their records. A
//! lease record (a field of the hash `<bucket key>:leases`) is `"units expiry"`.
//!
//! Numbers are decimal integers with an optional `-` and nothing else, as the
//! script's patterns read them. The script refuses magnitudes of 2^53 and more
//! (Lua's doubles); the module reads the core's range, so a value it wrote past
//! 2^53 is one the script reports as corrupt (docs/redis.md, "The module").

/// A bucket as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stored {
    pub balance: i128,
    pub last: i64,
    /// `None`: no constraint but the cap (`H == cap - B`).
    pub headroom: Option<u128>,
    /// Units leased out and the earliest expiry of their records; `(0, _)`
    /// when none (the five-field form with `C` 0 reads as no lease).
    pub leased: u128,
    pub earliest: Option<i64>,
}

/// Reads a bucket's value; `None` when it is not one of the three forms.
#[must_use]
pub fn parse_bucket(value: &[u8]) -> Option<Stored> {
    let mut fields = value.split(|&c| c == b' ');
    let balance = signed(fields.next()?)?;
    let last = i64::try_from(signed(fields.next()?)?).ok()?;
    let Some(third) = fields.next() else {
        return Some(Stored {
            balance,
            last,
            headroom: None,
            leased: 0,
            earliest: None,
        });
    };
    let Some(fourth) = fields.next() else {
        // "B L H": H has no sign.
        return Some(Stored {
            balance,
            last,
            headroom: Some(unsigned(third)?),
            leased: 0,
            earliest: None,
        });
    };
    let fifth = fields.next()?;
    if fields.next().is_some() {
        return None;
    }
    let headroom = match signed(third)? {
        -1 => None,
        h => Some(u128::try_from(h).ok()?),
    };
    let leased = unsigned(fourth)?;
    let earliest = i64::try_from(signed(fifth)?).ok()?;
    Some(Stored {
        balance,
        last,
        headroom,
        leased,
        earliest: Some(earliest),
    })
}

/// A bucket's value: the two- or three-field form without leases, the
/// five-field form with them.
#[must_use]
pub fn format_bucket(
    balance: i128,
    last: i64,
    headroom: Option<u128>,
    leased: u128,
    earliest: Option<i64>,
) -> String {
    match (leased, headroom) {
        (0, None) => format!("{balance} {last}"),
        (0, Some(h)) => format!("{balance} {last} {h}"),
        (c, h) => {
            let h = h.map_or_else(|| "-1".to_owned(), |h| h.to_string());
            format!("{balance} {last} {h} {c} {}", earliest.unwrap_or(last))
        }
    }
}

/// A lease record: its units and expiry; `None` when it is not `"units expiry"`.
#[must_use]
pub fn parse_lease(value: &[u8]) -> Option<(u128, i64)> {
    let mut fields = value.split(|&c| c == b' ');
    let units = unsigned(fields.next()?)?;
    let expiry = i64::try_from(signed(fields.next()?)?).ok()?;
    fields.next().is_none().then_some((units, expiry))
}

/// `-?[0-9]+` as an i128.
#[must_use]
pub fn signed(text: &[u8]) -> Option<i128> {
    match text.split_first() {
        Some((b'-', digits)) => i128::try_from(unsigned(digits)?).ok().map(|v| -v),
        _ => i128::try_from(unsigned(text)?).ok(),
    }
}

/// `[0-9]+` as a u128.
#[must_use]
pub fn unsigned(text: &[u8]) -> Option<u128> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_forms_read_and_write_back() {
        for text in ["5 -7", "-300 12 40", "12 7 -1 3 99", "0 0 4 2 -5"] {
            let s = parse_bucket(text.as_bytes()).unwrap();
            assert_eq!(
                format_bucket(s.balance, s.last, s.headroom, s.leased, s.earliest),
                text
            );
        }
        let s = parse_bucket(b"12 7 -1 3 99").unwrap();
        assert_eq!((s.headroom, s.leased, s.earliest), (None, 3, Some(99)));
    }

    #[test]
    fn anything_else_is_not_a_bucket() {
        for text in [
            "",
            "5",
            "5 ",
            " 5 7",
            "5  7",
            "+5 7",
            "5 7 -3",
            "5 7 -2 1 1",
            "5 7 1 -1 1",
            "5 7 1 1",
            "5 7 1 1 1 1",
            "a b",
            "5 7\n",
            "1.5 7",
            "5 99999999999999999999",
        ] {
            assert_eq!(parse_bucket(text.as_bytes()), None, "{text:?}");
        }
    }

    #[test]
    fn values_beyond_lua_doubles_are_read() {
        let big = (1i128 << 90) + 1;
        let s = parse_bucket(format!("{big} 3").as_bytes()).unwrap();
        assert_eq!(s.balance, big);
        assert_eq!(parse_lease(b"4000000 -12"), Some((4_000_000, -12)));
        assert_eq!(parse_lease(b"-4 12"), None);
    }
}
