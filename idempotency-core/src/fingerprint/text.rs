//! Canonical JSON from text in one pass: a strict parser that writes the canonical text as
//! it reads, copying the input wherever the two agree.

use super::*;

/// The deepest nesting of arrays and objects that has a canonical form: serde_json's limit
/// (it refuses a 128th level), which this module had while it parsed through serde_json.
pub(super) const MAX_DEPTH: usize = 127;

/// Where the canonical text of a JSON text is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Canonical {
    /// The input is its own canonical text (nothing was written).
    Input,
    /// In the output buffer, from where it was when the canonicaliser was called.
    Written,
}

/// Reads the JSON text `bytes` and writes its canonical text into `out` (after what `out`
/// holds), unless the text is already canonical: `None` (with part of the text possibly
/// written) when `bytes` are not JSON or nest too deep.
///
/// One pass: the output is the input, but for what canonicalisation changes. Bytes are
/// copied lazily, a run at a time, only where the output departs from the input (whitespace
/// left out, a number or a string written again, an object's members reordered), so a
/// compact text costs little more than its parse. An object whose members are out of order
/// is reordered when it closes: its members' canonical texts are already written, one after
/// the other, and are moved into name order.
pub(super) fn canonicalise(bytes: &[u8], out: &mut Vec<u8>) -> Option<Canonical> {
    // Outside strings JSON is ASCII, so this checks the UTF-8 of every string at once.
    std::str::from_utf8(bytes).ok()?;
    let origin = out.len();
    let mut c = Canonicaliser {
        s: bytes,
        i: 0,
        copy_from: 0,
        out,
        members: Vec::new(),
        names: Vec::new(),
        scratch: Vec::new(),
    };
    c.ws();
    c.value(0)?;
    c.ws();
    if c.i != bytes.len() {
        return None;
    }
    if c.copy_from == 0 && c.out.len() == origin {
        return Some(Canonical::Input);
    }
    c.flush(bytes.len());
    Some(Canonical::Written)
}

/// A member of an object being read: where its canonical text (`"name":value`) is in the
/// output, and its decoded name.
#[derive(Debug, Clone, Copy)]
struct Member {
    /// The name's [`name_head`].
    head: u64,
    /// Where the name's decoded bytes are: in the input (a name without escapes), or in the
    /// decoded names.
    name_at: usize,
    name_len: usize,
    decoded: bool,
    /// The member's canonical text in the output.
    start: usize,
    end: usize,
}

struct Canonicaliser<'a, 'o> {
    s: &'a [u8],
    i: usize,
    /// Where the run of input not yet copied to the output starts: everything read before it
    /// has its canonical text in `out`, and the input from it up to `i` is its own.
    copy_from: usize,
    out: &'o mut Vec<u8>,
    /// The members of the objects being read, innermost last.
    members: Vec<Member>,
    /// Decoded strings that had escapes: the names of the objects being read, and the string
    /// being written.
    names: Vec<u8>,
    /// Where an object's members are moved from when they are reordered.
    scratch: Vec<u8>,
}

impl Canonicaliser<'_, '_> {
    /// Where the output would be if the input run were copied now.
    #[inline]
    fn out_pos(&self) -> usize {
        self.out.len() + (self.i - self.copy_from)
    }

    /// Copies the input run up to `to`, which the next output byte comes after.
    #[inline]
    fn flush(&mut self, to: usize) {
        self.out.extend_from_slice(&self.s[self.copy_from..to]);
        self.copy_from = to;
    }

    /// Skips whitespace, which the output leaves out.
    #[inline]
    fn ws(&mut self) {
        if let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.ws_run();
        }
    }

    #[cold]
    fn ws_run(&mut self) {
        let from = self.i;
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
        self.flush(from);
        self.copy_from = self.i;
    }

    /// One value at `depth` enclosing arrays and objects.
    fn value(&mut self, depth: usize) -> Option<()> {
        match *self.s.get(self.i)? {
            b'"' => {
                let names = self.names.len();
                self.string()?;
                self.names.truncate(names);
                Some(())
            }
            b'-' | b'0'..=b'9' => self.number(),
            b'{' => self.object(depth),
            b'[' => self.array(depth),
            b'n' => self.literal(b"null"),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            _ => None,
        }
    }

    fn literal(&mut self, text: &[u8]) -> Option<()> {
        if !self.s.get(self.i..)?.starts_with(text) {
            return None;
        }
        self.i += text.len();
        Some(())
    }

    fn number(&mut self) -> Option<()> {
        let start = self.i;
        // The common case first, without building a `Number`: an integer already canonical
        // (no fraction or exponent, no leading zero, not `-0`, at most 21 digits).
        let negative = usize::from(self.s[start] == b'-');
        let mut j = start + negative;
        match self.s.get(j) {
            Some(b'1'..=b'9') => {
                j += 1;
                while let Some(b'0'..=b'9') = self.s.get(j) {
                    j += 1;
                }
            }
            Some(b'0') if negative == 0 => j += 1,
            _ => j = start,
        }
        if j > start
            && j - start - negative <= 21
            && !matches!(self.s.get(j), Some(b'.' | b'e' | b'E' | b'0'..=b'9'))
        {
            self.i = j;
            return Some(());
        }
        let (number, end) = scan_number(self.s, start)?;
        self.i = end;
        if !is_canonical_integer(&number) {
            self.flush(start);
            write_number(&number, &mut *self.out);
            self.copy_from = end;
        }
        Some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.i += 1;
        self.ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
            return Some(());
        }
        loop {
            self.value(depth + 1)?;
            self.ws();
            match *self.s.get(self.i)? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b']' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.i += 1;
        self.ws();
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
            return Some(());
        }
        let base = self.members.len();
        let names_base = self.names.len();
        let content = self.out_pos();
        let mut sorted = true;
        loop {
            if self.s.get(self.i) != Some(&b'"') {
                return None;
            }
            let start = self.out_pos();
            let (quote, names_before) = (self.i, self.names.len());
            let decoded = self.string()?;
            // Where a plain name ends (before its closing quote).
            let name_end = self.i - 1;
            self.ws();
            if self.s.get(self.i) != Some(&b':') {
                return None;
            }
            self.i += 1;
            self.ws();
            self.value(depth + 1)?;
            let (name_at, name_len) = if decoded {
                (names_before, self.names.len() - names_before)
            } else {
                (quote + 1, name_end - quote - 1)
            };
            let head = if decoded {
                name_head(&self.names, name_at, name_len)
            } else {
                name_head(self.s, name_at, name_len)
            };
            let end = self.out_pos();
            // Names in order as written (ties keep their order) need no reordering.
            if sorted && self.members.len() > base {
                let previous = &self.members[self.members.len() - 1];
                sorted = previous.head < head
                    || (previous.head == head
                        && self.name(previous.name_at, previous.name_len, previous.decoded)
                            <= self.name(name_at, name_len, decoded));
            }
            self.members.push(Member {
                head,
                name_at,
                name_len,
                decoded,
                start,
                end,
            });
            self.ws();
            match *self.s.get(self.i)? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b'}' => break,
                _ => return None,
            }
        }
        if !sorted {
            self.reorder(base, content);
        }
        self.i += 1;
        self.members.truncate(base);
        self.names.truncate(names_base);
        Some(())
    }

    /// The decoded bytes of a name.
    #[inline]
    fn name(&self, at: usize, len: usize, decoded: bool) -> &[u8] {
        let from = if decoded { &self.names } else { self.s };
        &from[at..at + len]
    }

    /// Canonical order: by decoded name, then as written.
    #[inline]
    fn order(&self, a: &Member, b: &Member) -> std::cmp::Ordering {
        a.head
            .cmp(&b.head)
            .then_with(|| {
                self.name(a.name_at, a.name_len, a.decoded)
                    .cmp(self.name(b.name_at, b.name_len, b.decoded))
            })
            .then(a.start.cmp(&b.start))
    }

    /// Moves the members from `base` on, whose canonical texts follow each other from
    /// `content` in the output (a comma apart), into canonical order. The input is at the
    /// object's closing brace.
    #[cold]
    fn reorder(&mut self, base: usize, content: usize) {
        let mut members = std::mem::take(&mut self.members);
        let members_of_object = &mut members[base..];
        if members_of_object.len() <= 16 {
            // Insertion sort: objects are small, and most members move little.
            for k in 1..members_of_object.len() {
                let mut j = k;
                while j > 0
                    && self.order(&members_of_object[j - 1], &members_of_object[j])
                        == std::cmp::Ordering::Greater
                {
                    members_of_object.swap(j - 1, j);
                    j -= 1;
                }
            }
        } else {
            members_of_object.sort_unstable_by(|a, b| self.order(a, b));
        }
        // The members' texts: still in the input when none of the object has been written
        // yet (the object is canonical but for its order), otherwise in the output, moved out
        // of the way first.
        // (`self.out.len() <= content`: nothing after the object's start has been written,
        // so its text is the input run from `copy_from`, which the output continues.)
        let (from, at) = if self.out.len() <= content {
            let at = self.copy_from + (content - self.out.len());
            self.flush(at);
            self.copy_from = self.i;
            (self.s, at)
        } else {
            self.flush(self.i);
            self.scratch.clear();
            self.scratch.extend_from_slice(&self.out[content..]);
            self.out.truncate(content);
            (&self.scratch[..], 0)
        };
        for (j, m) in members[base..].iter().enumerate() {
            if j > 0 {
                self.out.push(b',');
            }
            self.out
                .extend_from_slice(&from[at + (m.start - content)..at + (m.end - content)]);
        }
        self.members = members;
    }

    /// A string starting at its opening quote: whether it had escapes. One without is its
    /// own canonical text, between the quotes; one with escapes is decoded (appended to
    /// `names`, where a name stays until its object closes) and written in canonical form.
    #[inline]
    fn string(&mut self) -> Option<bool> {
        let quote = self.i;
        self.i += 1;
        let start = self.i;
        self.i += plain_run(self.s.get(self.i..)?);
        match self.s.get(self.i)? {
            b'"' => {
                self.i += 1;
                return Some(false);
            }
            b'\\' => {}
            _ => return None,
        }
        let from = self.names.len();
        self.names.extend_from_slice(&self.s[start..self.i]);
        self.i = decode_escaped(self.s, self.i, &mut self.names)?;
        self.flush(quote);
        write_string(&self.names[from..], &mut *self.out);
        self.copy_from = self.i;
        Some(true)
    }
}

/// Decodes the rest of a string from `i` (at its first backslash) to its closing quote,
/// appending the decoded bytes to `out`: where the string ends (after the quote), or `None`
/// for a string JSON does not allow (a bad escape, a lone surrogate, a control character,
/// no closing quote).
pub(super) fn decode_escaped(s: &[u8], mut i: usize, out: &mut Vec<u8>) -> Option<usize> {
    loop {
        match *s.get(i)? {
            b'"' => return Some(i + 1),
            b'\\' => {
                i += 1;
                let decoded = match *s.get(i)? {
                    b'"' => b'"',
                    b'\\' => b'\\',
                    b'/' => b'/',
                    b'b' => 0x08,
                    b'f' => 0x0c,
                    b'n' => b'\n',
                    b'r' => b'\r',
                    b't' => b'\t',
                    b'u' => {
                        let (c, end) = unicode_escape(s, i + 1)?;
                        let mut buf = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                        i = end;
                        continue;
                    }
                    _ => return None,
                };
                out.push(decoded);
                i += 1;
            }
            0x00..=0x1f => return None,
            _ => {
                let run = plain_run(&s[i..]);
                out.extend_from_slice(&s[i..i + run]);
                i += run;
            }
        }
    }
}

/// The character of a `\u` escape whose four hex digits start at `i`, joining a surrogate
/// pair, and where the escape ends; `None` for a lone surrogate.
fn unicode_escape(s: &[u8], i: usize) -> Option<(char, usize)> {
    let high = hex4(s, i)?;
    let (code, end) = match high {
        0xd800..=0xdbff => {
            if s.get(i + 4..i + 6) != Some(b"\\u") {
                return None;
            }
            let low = hex4(s, i + 6)?;
            if !(0xdc00..=0xdfff).contains(&low) {
                return None;
            }
            let code = 0x10000 + ((u32::from(high) - 0xd800) << 10) + (u32::from(low) - 0xdc00);
            (code, i + 10)
        }
        0xdc00..=0xdfff => return None,
        _ => (u32::from(high), i + 4),
    };
    Some((char::from_u32(code)?, end))
}

fn hex4(s: &[u8], i: usize) -> Option<u16> {
    let mut v = 0u16;
    for &d in s.get(i..i + 4)? {
        v = v * 16 + u16::from((d as char).to_digit(16)? as u8);
    }
    Some(v)
}

/// Whether a number's text is its canonical text: an integer without a fraction or an
/// exponent, without leading zeros, of at most 21 digits (beyond them the canonical text
/// has an exponent), and not `-0` (which is `0`).
pub(super) fn is_canonical_integer(n: &Number<'_>) -> bool {
    n.frac.is_empty()
        && n.exp.is_empty()
        && n.int.len() <= 21
        && match n.int {
            b"0" => !n.negative,
            int => int[0] != b'0',
        }
}

/// The length of the run of string bytes that need no decoding: up to a quote, a backslash,
/// a control character (not allowed in a string) or the end. Eight bytes at a time.
pub(super) fn plain_run(s: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    // The high bit of each byte of `v` that is zero. A borrow can also flag a byte above a
    // zero byte, never one below it, so the lowest flag is exact.
    let zero = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let mut i = 0;
    while let Some(chunk) = s.get(i..i + 8) {
        let w = u64::from_le_bytes(chunk.try_into().unwrap_or_default());
        // Bytes below 0x20; bytes from 0x80 up are never flagged (`!w` clears their bit).
        let control = w.wrapping_sub(0x20 * ONES) & !w & HIGH;
        let found =
            zero(w ^ (u64::from(b'"') * ONES)) | zero(w ^ (u64::from(b'\\') * ONES)) | control;
        if found != 0 {
            return i + (found.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i + s[i..]
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .unwrap_or(s.len() - i)
}

/// The first eight bytes of the name at `buf[at..at + len]`, big-endian, zero-padded: most
/// comparisons of names are settled by them, read once as a number, without comparing the
/// slices (a shorter name can only tie with a longer one here, never be ordered after it).
#[inline]
pub(super) fn name_head(buf: &[u8], at: usize, len: usize) -> u64 {
    if let Some(window) = buf.get(at..).and_then(|b| b.first_chunk::<8>()) {
        // Eight bytes read at once; those after a shorter name masked off.
        let word = u64::from_be_bytes(*window);
        return if len >= 8 {
            word
        } else {
            word & !(u64::MAX >> (8 * len))
        };
    }
    let mut head = 0u64;
    for (i, &b) in buf[at..at + len.min(8)].iter().enumerate() {
        head |= u64::from(b) << (56 - 8 * i);
    }
    head
}
