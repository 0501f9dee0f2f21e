use super::*;

#[test]
fn canonical_form_sorts_every_depth() {
    let a = Fingerprint::from_json_slice(br#"{"a":1,"b":[{"d":1,"c":2}]}"#).unwrap();
    let b = Fingerprint::from_json_slice(br#"{"b":[{"c":2,"d":1}],"a":1}"#).unwrap();
    assert_eq!(a, b);
    let v: serde_json::Value =
        serde_json::from_str(r#"{ "z" : {"y":[3, {"b":null,"a":"\u00e9"}]}, "a":true }"#).unwrap();
    assert_eq!(
        canonical_json(&v),
        r#"{"a":true,"z":{"y":[3,{"a":"é","b":null}]}}"#
    );
}

#[test]
fn json_differences_matter() {
    let a = Fingerprint::from_json_slice(br#"{"a":[1,2]}"#).unwrap();
    let b = Fingerprint::from_json_slice(br#"{"a":[2,1]}"#).unwrap();
    let c = Fingerprint::from_json_slice(br#"{"a":"1"}"#).unwrap();
    let d = Fingerprint::from_json_slice(br#"{"a":1}"#).unwrap();
    assert_ne!(a, b);
    assert_ne!(c, d);
    assert!(Fingerprint::from_json_slice(b"{\"a\":").is_err());
}

/// Found by the `fingerprint_text` fuzz target: with serde_json's default best-effort
/// float parsing, `40201e200` read as 4.0200999999999997e204, whose canonical text read
/// back as 4.0201e204, so one number written two ways had two fingerprints. The workspace
/// enables serde_json's `float_roundtrip`, which parses every float exactly.
#[test]
fn floats_parse_exactly_so_canonical_text_is_a_fixed_point() {
    for (a, b) in [
        (&b"40201e200"[..], &b"4.0201e204"[..]),
        (b"2.670434942875878e-306", b"0.2670434942875878e-305"),
        (b"[1.5, 0.1]", b"[15e-1, 1e-1]"),
    ] {
        assert_eq!(
            Fingerprint::from_json_slice(a).unwrap(),
            Fingerprint::from_json_slice(b).unwrap(),
            "{} and {}",
            String::from_utf8_lossy(a),
            String::from_utf8_lossy(b)
        );
        let v: serde_json::Value = serde_json::from_slice(a).unwrap();
        let c = canonical_json(&v);
        let again: serde_json::Value = serde_json::from_str(&c).unwrap();
        assert_eq!(again, v);
        assert_eq!(canonical_json(&again), c);
    }
}

/// Found by the `fingerprint_value` fuzz target: `-0.0` and `0.0` are equal values but
/// were written as two canonical texts, so they had two fingerprints. Since numbers are
/// written by their exact value, every zero is `0`, integer or float.
#[test]
fn signed_zeros_are_one_value() {
    let neg: serde_json::Value = serde_json::from_str("-0.0").unwrap();
    let pos: serde_json::Value = serde_json::from_str("0.0").unwrap();
    assert_eq!(neg, pos);
    assert_eq!(canonical_json(&neg), "0");
    assert_eq!(Fingerprint::from_json(&neg), Fingerprint::from_json(&pos));
    assert_eq!(
        Fingerprint::from_json_slice(br#"{"a":[-0.0, -0e3]}"#).unwrap(),
        Fingerprint::from_json_slice(br#"{"a":[0.0, 0e0]}"#).unwrap()
    );
    // An integer zero is the same number as a float zero (it was not, while numbers were
    // written as serde_json's `Value` prints them).
    assert_eq!(
        Fingerprint::from_json_slice(b"0").unwrap(),
        Fingerprint::from_json_slice(b"0.0").unwrap()
    );
    assert_eq!(
        Fingerprint::from_json(&serde_json::json!(0)),
        Fingerprint::from_json(&serde_json::json!(-0.0))
    );
}

#[track_caller]
fn canonical(text: &str) -> String {
    canonical_json_slice(text.as_bytes())
        .unwrap_or_else(|e| panic!("{text:?} has no canonical form: {e}"))
}

/// The decision: one text per exact value, every digit kept, ECMAScript's layout.
#[test]
fn numbers_are_written_by_exact_value() {
    for (text, expected) in [
        ("1", "1"),
        ("1.0", "1"),
        ("1e0", "1"),
        ("10e-1", "1"),
        ("0.1e1", "1"),
        ("100E-2", "1"),
        ("1E+0", "1"),
        ("-0", "0"),
        ("0.0", "0"),
        ("-0.0", "0"),
        ("-0e5", "0"),
        ("0e-5", "0"),
        ("0.000", "0"),
        ("100", "100"),
        ("1e2", "100"),
        ("1230000", "1230000"),
        ("12.34e1", "123.4"),
        ("1.5", "1.5"),
        ("-1.50", "-1.5"),
        ("0.0012300", "0.00123"),
        ("0.000001", "0.000001"),
        ("1e-6", "0.000001"),
        ("1e-7", "1e-7"),
        ("1.5e-7", "1.5e-7"),
        ("123e-10", "1.23e-8"),
        ("1e20", "100000000000000000000"),
        ("123456789012345678901", "123456789012345678901"),
        ("1e21", "1e+21"),
        ("1234567890123456789012", "1.234567890123456789012e+21"),
        ("0.10000000000000000001", "0.10000000000000000001"),
        ("18446744073709551617", "18446744073709551617"),
        ("-9223372036854775809", "-9223372036854775809"),
        ("1e400", "1e+400"),
        ("-2.50E-400", "-2.5e-400"),
        ("0.00000000000000000000000000000000000000000001", "1e-44"),
    ] {
        assert_eq!(canonical(text), expected, "{text}");
        assert_eq!(canonical(expected), expected, "{expected} is a fixed point");
        assert_eq!(
            Fingerprint::from_json_slice(text.as_bytes()).unwrap(),
            Fingerprint::from_bytes(expected.as_bytes())
        );
    }
    // 1, 1.0, 1e0 and 10e-1 are one payload, alone, as values and as request bodies.
    let one = json_body(br#"{"qty":1}"#);
    for body in [
        &br#"{"qty":1.0}"#[..],
        br#"{"qty":1e0}"#,
        br#"{"qty":10e-1}"#,
    ] {
        assert_eq!(json_body(body), one, "{}", String::from_utf8_lossy(body));
    }
    assert_eq!(
        Fingerprint::from_json(&serde_json::json!({"qty": 1})),
        Fingerprint::from_json(&serde_json::json!({"qty": 1.0}))
    );
}

/// Random number texts against an independent normalisation (sign, significant digits,
/// exponent): one canonical text per exact value, never one for two values; the text is
/// a fixed point, reads as the same `f64`, and another writing of the same value (more
/// zeros, the point moved into an exponent) has the same text.
#[test]
fn random_numbers_keep_their_value() {
    use std::collections::HashMap;
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15_u64);
    let digits = |len: u64, next: &mut dyn FnMut(u64) -> u64| -> String {
        (0..len)
            .map(|_| b"0000123456789"[next(13) as usize] as char)
            .collect()
    };
    let mut by_value: HashMap<(bool, String, i64), String> = HashMap::new();
    let mut by_text: HashMap<String, (bool, String, i64)> = HashMap::new();
    for _ in 0..20_000 {
        let negative = next(2) == 0;
        let int = match next(3) {
            0 => "0".to_string(),
            _ => format!("{}{}", 1 + next(9), digits(next(22), &mut next)),
        };
        let frac = match next(2) {
            0 => String::new(),
            _ => digits(1 + next(22), &mut next),
        };
        let exp: i64 = match next(3) {
            0 => 0,
            _ => next(700) as i64 - 350,
        };
        let mut text = format!("{}{int}", if negative { "-" } else { "" });
        if !frac.is_empty() {
            text.push('.');
            text.push_str(&frac);
        }
        if exp != 0 || next(4) == 0 {
            let e = if next(2) == 0 { 'e' } else { 'E' };
            let sign = if exp < 0 {
                "-"
            } else if next(2) == 0 {
                "+"
            } else {
                ""
            };
            let zeros = "0".repeat(next(3) as usize);
            text.push_str(&format!("{e}{sign}{zeros}{}", exp.abs()));
        }

        // The oracle: value = all × 10^(exp − |frac|), normalised.
        let all = format!("{int}{frac}");
        let significant = all.trim_start_matches('0');
        let key = if significant.is_empty() {
            (false, String::new(), 0)
        } else {
            let trimmed = significant.trim_end_matches('0');
            let shift = (significant.len() - trimmed.len()) as i64;
            (
                negative,
                trimmed.to_string(),
                exp - frac.len() as i64 + shift,
            )
        };

        let c = canonical(&text);
        assert_eq!(canonical(&c), c, "{text}: not a fixed point");
        let (f, g) = (text.parse::<f64>().unwrap(), c.parse::<f64>().unwrap());
        assert!(f == g, "{text} reads as {f:e}, its text {c} as {g:e}");
        if let Some(other) = by_value.insert(key.clone(), c.clone()) {
            assert_eq!(other, c, "{text}: one value, two texts");
        }
        if let Some(other) = by_text.insert(c.clone(), key.clone()) {
            assert_eq!(other, key, "{text}: two values, one text {c}");
        }

        // The same value written another way: `0.<digits, more zeros>e<exp>`.
        let more = next(4) as usize;
        let variant = format!(
            "{}0.{all}{}e{}",
            if negative { "-" } else { "" },
            "0".repeat(more),
            exp - frac.len() as i64 + all.len() as i64
        );
        assert_eq!(canonical(&variant), c, "{variant} and {text}");
    }
    assert!(
        by_value.len() > 15_000,
        "{} distinct values",
        by_value.len()
    );
}

/// Exponents beyond 36 digits take an arbitrary-precision path.
#[test]
fn enormous_exponents_are_exact() {
    let e40 = format!("1{}", "0".repeat(40));
    let e40m1 = "9".repeat(40);
    let e36 = "9".repeat(36);
    let e37 = format!("1{}", "0".repeat(36));
    for (text, expected) in [
        (format!("1e{e40}"), format!("1e+{e40}")),
        (format!("10e{e40m1}"), format!("1e+{e40}")),
        (format!("0.1e{e40}"), format!("1e+{e40m1}")),
        (format!("1e-{e40}"), format!("1e-{e40}")),
        (
            format!("0.001e-{e40m1}"),
            format!("1e-1{}2", "0".repeat(39)),
        ),
        (format!("12.5e-{e40}"), format!("1.25e-{e40m1}")),
        (format!("-1e{e36}"), format!("-1e+{e36}")),
        (format!("10e{e36}"), format!("1e+{e37}")),
        (format!("1e{e37}"), format!("1e+{e37}")),
        (format!("1e000{e37}"), format!("1e+{e37}")),
        (format!("0.1e{e37}"), format!("1e+{e36}")),
        (format!("0e{e40}"), "0".to_string()),
        (format!("1e-0000{}", "0".repeat(50)), "1".to_string()),
    ] {
        assert_eq!(canonical(&text), expected, "{text}");
        assert_eq!(
            canonical(&expected),
            expected,
            "{expected} is a fixed point"
        );
    }
    assert_distinct(
        format!("1e{e40}").as_bytes(),
        format!("1e{e40m1}").as_bytes(),
    );
}

#[test]
fn duplicate_members_keep_their_order() {
    assert_eq!(
        canonical(r#"{"b":0,"a":1,"\u0061":2,"a":{"y":1,"x":[1,1]}}"#),
        r#"{"a":1,"a":2,"a":{"x":[1,1],"y":1},"b":0}"#
    );
    // Which duplicate wins differs between parsers, so their order is part of the payload.
    assert_distinct(br#"{"a":1,"a":2}"#, br#"{"a":2,"a":1}"#);
    assert_eq!(
        json_body(br#"{"a":1,"b":3,"a":2}"#),
        json_body(br#"{ "b":3, "a":1, "a":2 }"#)
    );
}

/// Escapes are resolved and strings written the way serde_json writes them.
#[test]
fn strings_are_normalised() {
    assert_eq!(
        canonical(r#"["\u00e9", "\u00E9", "é", "\/", "\ud83d\ude00", "\u0000\u001F\u007f"]"#),
        "[\"é\",\"é\",\"é\",\"/\",\"\u{1f600}\",\"\\u0000\\u001f\u{7f}\"]"
    );
    let mut all = String::new();
    for c in (0u8..0x80)
        .map(char::from)
        .chain(['é', '\u{2028}', '\u{ffff}', '😀'])
    {
        all.push(c);
    }
    let plain = serde_json::to_string(&all).unwrap();
    assert_eq!(canonical(&plain), plain);
    let mut escaped = String::from("\"");
    for c in all.chars() {
        let mut units = [0u16; 2];
        for unit in c.encode_utf16(&mut units) {
            escaped.push_str(&format!("\\u{unit:04X}"));
        }
    }
    escaped.push('"');
    assert_eq!(canonical(&escaped), plain);
}

/// Text that is not JSON has no canonical form: `from_json_slice` fails and a request
/// body is hashed as its bytes. On every input here serde_json agrees that it is not JSON.
#[test]
fn only_strict_json_is_canonicalised() {
    let bad: &[&[u8]] = &[
        b"",
        b"  ",
        b"01",
        b"-01",
        b"1.",
        b".5",
        b"+1",
        b"1e",
        b"1e+",
        b"-",
        b"--1",
        b"0x10",
        b"NaN",
        b"Infinity",
        b"[1,]",
        b"[,1]",
        b"[1 2]",
        br#"{"a":1,}"#,
        br#"{"a" 1}"#,
        b"{1:2}",
        br#"{"a":}"#,
        b"[",
        b"{",
        b"\"abc",
        b"1 2",
        b"nul",
        b"truex",
        b"True",
        b"\xef\xbb\xbf1",
        br#""\x""#,
        b"\"a\nb\"",
        b"\"\t\"",
        b"\"\xff\"",
        b"\"\xc3\"",
        br#""\ud800""#,
        br#""\udc00""#,
        br#""\ud800\u0041""#,
        br#""\ud800\n""#,
        br#""\u12""#,
        br#""\u12g4""#,
        b"[1]\x00",
        b"\x0c1",
    ];
    for text in bad {
        let shown = String::from_utf8_lossy(text);
        assert!(
            serde_json::from_slice::<serde_json::Value>(text).is_err(),
            "serde_json reads {shown:?}"
        );
        assert!(Fingerprint::from_json_slice(text).is_err(), "{shown:?}");
        assert!(canonical_json_slice(text).is_err(), "{shown:?}");
        let mut spaced = text.to_vec();
        spaced.push(b' ');
        assert_ne!(
            json_body(text),
            json_body(&spaced),
            "{shown:?} is hashed raw"
        );
    }
    // serde_json's errors (with their positions) are passed on.
    let err = Fingerprint::from_json_slice(b"[1,]").unwrap_err();
    assert!(err.to_string().contains("line 1 column 4"), "{err}");
    let good: &[&[u8]] = &[
        b" \t\n\r1 \t\n\r",
        b"\"\"",
        b"[]",
        b"{}",
        b"[[],{}]",
        b"-0",
        b"\"\xf0\x9f\x98\x80\"",
        br#"{"":null}"#,
    ];
    for text in good {
        let shown = String::from_utf8_lossy(text);
        assert!(
            serde_json::from_slice::<serde_json::Value>(text).is_ok(),
            "{shown:?}"
        );
        assert!(Fingerprint::from_json_slice(text).is_ok(), "{shown:?}");
    }
}

/// The depth bound is serde_json's (127 levels), and deeper text never overflows the stack.
#[test]
fn nesting_is_bounded() {
    let arrays = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let objects = |n: usize| format!("{}1{}", r#"{"a":"#.repeat(n), "}".repeat(n));
    for n in [126, 127] {
        for text in [arrays(n), objects(n)] {
            assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok());
            assert_eq!(canonical(&text), text);
        }
    }
    for n in [128, 129, 100_000] {
        for text in [arrays(n), objects(n)] {
            if n < 1000 {
                assert!(serde_json::from_str::<serde_json::Value>(&text).is_err());
            }
            assert!(Fingerprint::from_json_slice(text.as_bytes()).is_err());
            let mut spaced = text.clone().into_bytes();
            spaced.push(b' ');
            assert_ne!(json_body(text.as_bytes()), json_body(&spaced), "hashed raw");
        }
    }
    // Unclosed, far too deep.
    assert!(Fingerprint::from_json_slice("[".repeat(1_000_000).as_bytes()).is_err());
}

/// A `Value` and the text serde_json writes for it have one fingerprint.
#[test]
fn a_value_and_its_text_agree() {
    use serde_json::json;
    let values = [
        json!(null),
        json!([true, false]),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(0),
        json!(-0.0),
        json!(1.0),
        json!(1e20),
        json!(1e21),
        json!(1.5e-7),
        json!(1e-6),
        json!(123.0),
        json!(5e-324),
        json!(f64::MAX),
        json!(f64::MIN_POSITIVE),
        json!(9007199254740993.0),
        json!(0.1),
        json!(-1234.5678e-200),
        json!({"b": {"d": [1, "x"], "c": 2.5}, "a": "\u{0}\"\\\n\u{1f}é😀", "": []}),
    ];
    for v in values {
        let text = serde_json::to_vec(&v).unwrap();
        let shown = String::from_utf8_lossy(&text);
        assert_eq!(
            canonical_json(&v),
            canonical_json_slice(&text).unwrap(),
            "{shown}"
        );
        assert_eq!(
            Fingerprint::from_json(&v),
            Fingerprint::from_json_slice(&text).unwrap(),
            "{shown}"
        );
        assert_eq!(
            Fingerprint::from_json(&v),
            Fingerprint::from_bytes(canonical_json(&v).as_bytes())
        );
    }
    assert_eq!(canonical_json(&json!(1e21)), "1e+21");
    assert_eq!(canonical_json(&json!(1e20)), "100000000000000000000");
    assert_eq!(canonical_json(&json!(-0.5)), "-0.5");
}

/// A JSON request body, fingerprinted as the HTTP layer does.
fn json_body(body: &[u8]) -> Fingerprint {
    Fingerprint::builder()
        .method("POST")
        .path("/payments")
        .content_type("application/json")
        .body(body)
        .finish()
}

/// Both paths (`from_json_slice` and a JSON request body) must tell `a` and `b` apart.
#[track_caller]
fn assert_distinct(a: &[u8], b: &[u8]) {
    let (ta, tb) = (String::from_utf8_lossy(a), String::from_utf8_lossy(b));
    let fa = Fingerprint::from_json_slice(a);
    let fb = Fingerprint::from_json_slice(b);
    assert!(fa.is_ok(), "{ta} is JSON: {fa:?}");
    assert!(fb.is_ok(), "{tb} is JSON: {fb:?}");
    assert_ne!(fa.unwrap(), fb.unwrap(), "{ta} and {tb} (from_json_slice)");
    assert_ne!(json_body(a), json_body(b), "{ta} and {tb} (request body)");
}

/// Release blocker: serde_json's `Value` holds an f64, so every decimal that rounds to
/// the same double had one fingerprint, and the second request replayed the first's
/// outcome instead of getting a mismatch.
#[test]
fn decimals_keep_every_digit() {
    assert_distinct(
        br#"{"amount":0.1}"#,
        br#"{"amount":0.10000000000000000001}"#,
    );
    assert_distinct(b"0.1", b"0.10000000000000000001");
    assert_distinct(b"1.0000000000000002", b"1.00000000000000021");
    assert_distinct(b"[9007199254740993.0]", b"[9007199254740992.0]");
}

#[test]
fn integers_beyond_64_bits_keep_every_digit() {
    assert_distinct(b"18446744073709551616", b"18446744073709551617");
    assert_distinct(b"-9223372036854775809", b"-9223372036854775810");
    assert_distinct(
        br#"{"id":123456789012345678901234567890}"#,
        br#"{"id":123456789012345678901234567891}"#,
    );
}

#[test]
fn huge_and_tiny_exponents_keep_every_digit() {
    assert_distinct(b"1e400", b"2e400");
    assert_distinct(b"1e-400", b"2e-400");
    assert_distinct(b"1e-400", b"0");
    assert_distinct(b"[1E+309]", b"[-1E+309]");
    // The same exact value written twice is still one payload.
    assert_eq!(json_body(b"1e400"), json_body(b" 10e399 "));
}

/// serde_json's `Value` keeps the last of two members with one name, so the first one
/// silently did not count.
#[test]
fn duplicate_member_names_are_not_dropped() {
    assert_distinct(br#"{"a":1,"a":2}"#, br#"{"a":2}"#);
    assert_distinct(br#"{"a":1,"a":2}"#, br#"{"a":1}"#);
    assert_distinct(br#"{"x":{"a":1,"a":2}}"#, br#"{"x":{"a":2}}"#);
}

#[test]
fn builder_covers_every_part() {
    let base = || {
        Fingerprint::builder()
            .method("post")
            .path("/a")
            .query("x=1")
            .content_type("application/json")
    };
    let fp = base().body(br#"{"a":1,"b":2}"#).finish();
    assert_eq!(fp, base().body(br#"{"b":2, "a":1}"#).finish());
    assert_eq!(
        fp,
        Fingerprint::builder()
            .method("POST")
            .path("/a")
            .query("x=1")
            .content_type("application/json")
            .body(br#"{"b":2,"a":1}"#)
            .finish()
    );
    assert_ne!(fp, base().body(br#"{"a":1,"b":3}"#).finish());
    assert_ne!(fp, base().query("x=2").body(br#"{"a":1,"b":2}"#).finish());
    assert_ne!(
        fp,
        Fingerprint::builder()
            .method("PATCH")
            .path("/a")
            .query("x=1")
            .content_type("application/json")
            .body(br#"{"a":1,"b":2}"#)
            .finish()
    );
    // Bytes cannot move between parts.
    let p1 = Fingerprint::builder().path("/ab").query("c").finish();
    let p2 = Fingerprint::builder().path("/a").query("bc").finish();
    assert_ne!(p1, p2);
    // An empty body and no body differ from a body.
    assert_ne!(base().finish(), base().body(b"").finish());
    // Non-JSON bodies are raw: whitespace matters.
    let t1 = Fingerprint::builder()
        .content_type("text/plain")
        .body(b"a b")
        .finish();
    let t2 = Fingerprint::builder()
        .content_type("text/plain")
        .body(b"a  b")
        .finish();
    assert_ne!(t1, t2);
}

/// Headers are length-prefixed parts after the body, present only when added: without
/// them the digest is the one version 3 computed before headers existed (pinned here),
/// so records stored by older versions keep matching.
#[test]
fn headers_count_and_their_absence_keeps_older_digests() {
    let base = || Fingerprint::builder().method("PATCH").path("/books/1");
    // SHA-256 of the v3 stream: prefix, method, path, no query, no content type, raw `x`.
    assert_eq!(
        base().body(b"x").finish().to_hex(),
        "08a9ce02d1ec332882c4e9882eb09dc144c7ea5503b7e2e15332fc32a0c961e7"
    );
    let v1 = base().body(b"x").header("If-Match", "\"v1\"").finish();
    assert_ne!(v1, base().body(b"x").finish());
    assert_eq!(
        v1,
        base().body(b"x").header("if-match", b"\"v1\"").finish(),
        "names are case-insensitive"
    );
    assert_ne!(v1, base().body(b"x").header("if-match", "\"v2\"").finish());
    assert_ne!(
        v1,
        base().body(b"x").header("if-none-match", "\"v1\"").finish()
    );
    // Bytes cannot move between a name and its value, or between headers.
    assert_ne!(
        base().header("ab", "c").finish(),
        base().header("a", "bc").finish()
    );
    assert_ne!(
        base().header("a", "b").header("c", "d").finish(),
        base().header("a", "bc").finish()
    );
    // An empty value is still a header.
    assert_ne!(base().header("if-match", "").finish(), base().finish());
}

#[test]
fn hex_round_trip() {
    let fp = Fingerprint::from_bytes(b"x");
    assert_eq!(Fingerprint::from_hex(&fp.to_hex()).unwrap(), fp);
    assert!(Fingerprint::from_hex("zz").is_err());
    assert_eq!(Fingerprint::from_slice(fp.as_bytes()), Some(fp));
    assert_eq!(Fingerprint::from_slice(&[1, 2]), None);
}

#[test]
fn json_media_types() {
    assert!(is_json_media_type("application/json"));
    assert!(is_json_media_type("Application/JSON; charset=utf-8"));
    assert!(is_json_media_type("application/merge-patch+json"));
    assert!(!is_json_media_type("text/plain"));
    assert!(!is_json_media_type("application/jsonx"));
    assert!(is_json_media_type("  APPLICATION/VND.API+Json ;q=1"));
    assert!(is_json_media_type("application/+json"));
    for not_json in [
        "",
        "application/",
        "applicatio",
        "application/json+xml",
        "text/json",
        "application/jsön",
        "ápplication/json",
        "application/x-json5",
    ] {
        assert!(!is_json_media_type(not_json), "{not_json:?}");
    }
}

/// Random JSON text, written the way clients write it: compact or spaced, members in
/// order or not, duplicate names, escapes, numbers in every form.
fn random_json(next: &mut dyn FnMut(u64) -> u64, depth: u32, out: &mut String) {
    const NAMES: [&str; 9] = ["a", "b", "ab", r"a\u0062", "zz", "sku", r"\u00e9", "", "a"];
    const NUMBERS: [&str; 10] = [
        "0",
        "-0",
        "7",
        "-12",
        "100",
        "1.0",
        "2.50e1",
        "1e400",
        "0.000001",
        "123456789012345678901234",
    ];
    const STRINGS: [&str; 6] = [
        "x",
        "",
        "item number 1 with some text",
        r#"q\\\""#,
        r"\/",
        r"\n\u0001é😀",
    ];
    let ws = |next: &mut dyn FnMut(u64) -> u64, out: &mut String| {
        if next(4) == 0 {
            out.push_str([" ", "\n  ", "\t", "\r\n"][next(4) as usize]);
        }
    };
    ws(next, out);
    match if depth >= 4 { next(4) } else { next(6) } {
        0 => out.push_str(["null", "true", "false"][next(3) as usize]),
        1 => out.push_str(NUMBERS[next(NUMBERS.len() as u64) as usize]),
        2 | 3 => {
            out.push('"');
            out.push_str(STRINGS[next(STRINGS.len() as u64) as usize]);
            out.push('"');
        }
        4 => {
            out.push('[');
            for i in 0..next(4) {
                if i > 0 {
                    out.push(',');
                }
                random_json(next, depth + 1, out);
            }
            ws(next, out);
            out.push(']');
        }
        _ => {
            out.push('{');
            let n = next(5) as usize;
            let mut names: Vec<&str> = (0..n)
                .map(|_| NAMES[next(NAMES.len() as u64) as usize])
                .collect();
            if next(2) == 0 {
                // In canonical order as written, as many serialisers leave them.
                names.sort_unstable();
            }
            for (i, name) in names.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(next, out);
                out.push('"');
                out.push_str(name);
                out.push('"');
                ws(next, out);
                out.push(':');
                random_json(next, depth + 1, out);
                ws(next, out);
            }
            out.push('}');
        }
    }
    ws(next, out);
}

/// The writer copies spans of input that are already canonical (whole values, and
/// members from the name's quote to the end of the value); writing every token instead
/// must give the same text, for random text and for the canonical text itself (where
/// everything is a span).
#[test]
fn copied_spans_are_the_text_written_token_by_token() {
    let mut next = xorshift(0x2545_f491_4f6c_dd1d_u64);
    let by_tokens = |text: &[u8]| {
        let mut out = Vec::new();
        canonicalise_with::<_, false>(text, &mut out).then_some(out)
    };
    let mut copied_whole = 0;
    for round in 0..20_000 {
        let mut text = String::new();
        random_json(&mut next, 0, &mut text);
        let expected = by_tokens(text.as_bytes()).expect("random JSON is JSON");
        let written = canonical_json_slice(text.as_bytes()).unwrap();
        assert_eq!(written.as_bytes(), expected, "round {round}: {text}");
        // The canonical text is copied as it is, and is its own canonical text.
        let again = canonical_json_slice(written.as_bytes()).unwrap();
        assert_eq!(again, written, "round {round}: {text}");
        assert_eq!(by_tokens(written.as_bytes()).unwrap(), expected);
        copied_whole += usize::from(text == written);
        // And the digest is the digest of that text.
        assert_eq!(
            Fingerprint::from_json_slice(text.as_bytes()).unwrap(),
            Fingerprint::from_bytes(&expected),
            "round {round}: {text}"
        );
    }
    assert!(
        copied_whole > 1_000,
        "only {copied_whole} texts were already canonical"
    );
    // A body of the shape the HTTP layer sees most, compact and in order, is one span.
    let compact = canonical_json_slice(br#"{"b":[1,{"y":"\u00e9","x":-0}],"a":1.50}"#).unwrap();
    assert_eq!(compact, r#"{"a":1.5,"b":[1,{"x":0,"y":"é"}]}"#);
    assert_eq!(canonical_json_slice(compact.as_bytes()).unwrap(), compact);
}

/// Objects wider than the insertion sort's (more than 16 members, sorted another way), with
/// duplicate and escaped names, nested, compact or spaced: the same text as the tape
/// writer's.
#[test]
fn wide_objects_are_written_as_the_tape_writer_writes_them() {
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15_u64);
    const NAMES: [&str; 8] = ["a", "b", "ab", r"a\u0062", "zz", "z_note", r"\u00e9", ""];
    for round in 0..500 {
        let mut text = String::from("{");
        let members = 17 + next(40);
        for i in 0..members {
            if i > 0 {
                text.push_str([",", " , ", ",\n"][next(3) as usize]);
            }
            let name = NAMES[next(NAMES.len() as u64) as usize];
            text.push_str(&format!("\"{name}{}\":", next(30)));
            match next(3) {
                0 => text.push_str(&format!("{}", next(1000))),
                1 => text.push_str(&format!("{{\"y\":{i},\"x\":[1.50,\"\\u00e9\"]}}")),
                _ => random_json(&mut next, 1, &mut text),
            }
        }
        text.push('}');
        let mut expected = Vec::new();
        assert!(canonicalise_with::<_, false>(
            text.as_bytes(),
            &mut expected
        ));
        let written = canonical_json_slice(text.as_bytes()).unwrap();
        assert_eq!(written.as_bytes(), expected, "round {round}: {text}");
        assert_eq!(
            Fingerprint::from_json_slice(text.as_bytes()).unwrap(),
            Fingerprint::from_bytes(&expected)
        );
    }
}

/// A xorshift generator from `seed`: `next(n)` is a number below `n`.
fn xorshift(mut state: u64) -> impl FnMut(u64) -> u64 {
    move |n| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    }
}
