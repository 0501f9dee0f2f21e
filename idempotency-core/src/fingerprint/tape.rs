//! The canonicaliser before the one-pass one (`text`), kept as the tests' oracle: a strict
//! parser onto a flat tape, and a writer that sorts members and can copy what is already
//! canonical. Two independent implementations must give the same text for every input.

use super::text::{decode_escaped, is_canonical_integer, name_head, plain_run, MAX_DEPTH};
use super::*;

/// Writes the canonical text of the JSON text `bytes` into `out`; `false` (with part of the
/// text possibly written) when `bytes` are not JSON or nest too deep. One pass parses the
/// text into a flat tape (a node per value), a second writes it with object members sorted.
/// `VERBATIM` says whether spans of the input that are already in
/// canonical form are copied whole. Without it every token is written one by one: the
/// tests compare both writers, which must give the same text.
pub(super) fn canonicalise_with<S: Sink, const VERBATIM: bool>(bytes: &[u8], out: &mut S) -> bool {
    // Outside strings JSON is ASCII, so this checks the UTF-8 of every string at once.
    if std::str::from_utf8(bytes).is_err() {
        return false;
    }
    let mut parser = Parser {
        s: bytes,
        i: 0,
        tape: Vec::with_capacity(bytes.len() / 8 + 1),
        arena: Vec::new(),
    };
    if parser.document().is_none() {
        return false;
    }
    let mut writer = Writer::<VERBATIM> {
        s: bytes,
        tape: &parser.tape,
        arena: &parser.arena,
        members: Vec::new(),
    };
    writer.value(0, out);
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tag {
    /// `a..b`: the literal's text in the input (as for the other literals).
    Null,
    True,
    False,
    /// `a..b`: the number's text in the input.
    Number,
    /// `a..b`: the string's bytes between the quotes in the input, without escapes (so
    /// already canonical).
    Plain,
    /// `a..b`: the decoded string in the arena.
    Decoded,
    /// `a`: where the array starts in the input; `b`: the tape index after its last node.
    Array,
    /// `a`: where the object starts in the input; `b`: the tape index after its last node.
    /// Its members are name and value nodes in turn.
    Object,
}

/// The node's input text is its canonical text: a literal, a plain string, an integer
/// written as canonical, or an array or object without whitespace whose members are in
/// order and whose values are all verbatim.
pub(super) const VERBATIM: u8 = 1;
/// On a member name: the name, the colon and the value follow each other without
/// whitespace, so the member's input text runs from the name's opening quote to the end of
/// the value.
pub(super) const TIGHT: u8 = 2;
/// On an object: its members' names are plain and in canonical order as written.
pub(super) const SORTED: u8 = 4;

#[derive(Debug, Clone, Copy)]
pub(super) struct Node {
    tag: Tag,
    flags: u8,
    a: usize,
    b: usize,
    /// Where the value's text ends in the input.
    end: usize,
}

impl Node {
    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// Where the value's text starts in the input.
    fn start(&self) -> usize {
        match self.tag {
            // After the opening quote.
            Tag::Plain => self.a - 1,
            // Decoded strings are never copied from the input, so their start is not needed.
            _ => self.a,
        }
    }
}

pub(super) struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    tape: Vec<Node>,
    /// Decoded strings that had escapes.
    arena: Vec<u8>,
}

impl Parser<'_> {
    fn document(&mut self) -> Option<()> {
        self.ws();
        self.value(0)?;
        self.ws();
        (self.i == self.s.len()).then_some(())
    }

    /// Skips whitespace; whether there was any.
    fn ws(&mut self) -> bool {
        let from = self.i;
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
        self.i != from
    }

    fn node(&mut self, tag: Tag, flags: u8, a: usize, b: usize) {
        self.tape.push(Node {
            tag,
            flags,
            a,
            b,
            end: self.i,
        });
    }

    fn literal(&mut self, text: &[u8], tag: Tag) -> Option<()> {
        if !self.s.get(self.i..)?.starts_with(text) {
            return None;
        }
        let start = self.i;
        self.i += text.len();
        self.node(tag, VERBATIM, start, self.i);
        Some(())
    }

    /// One value at `depth` enclosing arrays and objects.
    fn value(&mut self, depth: usize) -> Option<()> {
        match *self.s.get(self.i)? {
            b'n' => self.literal(b"null", Tag::Null),
            b't' => self.literal(b"true", Tag::True),
            b'f' => self.literal(b"false", Tag::False),
            b'"' => self.string(),
            b'-' | b'0'..=b'9' => {
                let (number, end) = scan_number(self.s, self.i)?;
                let start = self.i;
                self.i = end;
                let flags = if is_canonical_integer(&number) {
                    VERBATIM
                } else {
                    0
                };
                self.node(Tag::Number, flags, start, end);
                Some(())
            }
            b'[' => self.array(depth),
            b'{' => self.object(depth),
            _ => None,
        }
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        let at = self.tape.len();
        self.node(Tag::Array, 0, self.i, 0);
        self.i += 1;
        let mut verbatim = !self.ws();
        if self.s.get(self.i) == Some(&b']') {
            self.i += 1;
        } else {
            loop {
                let element = self.tape.len();
                self.value(depth + 1)?;
                verbatim &= self.tape[element].has(VERBATIM) & !self.ws();
                match self.s.get(self.i)? {
                    b',' => {
                        self.i += 1;
                        verbatim &= !self.ws();
                    }
                    b']' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.close(at, verbatim);
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        let at = self.tape.len();
        self.node(Tag::Object, 0, self.i, 0);
        self.i += 1;
        let mut tight = !self.ws();
        let mut sorted = true;
        let mut values_verbatim = true;
        let mut previous: Option<NameKey<'_>> = None;
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
        } else {
            loop {
                if self.s.get(self.i) != Some(&b'"') {
                    return None;
                }
                let name = self.tape.len();
                self.string()?;
                let mut member_tight = !self.ws();
                if self.s.get(self.i) != Some(&b':') {
                    return None;
                }
                self.i += 1;
                member_tight &= !self.ws();
                let value = self.tape.len();
                self.value(depth + 1)?;
                let Node { tag, a, b, .. } = self.tape[name];
                if member_tight {
                    self.tape[name].flags |= TIGHT;
                }
                // Names in order as written (ties keep their order): compared as they are
                // in the input, so only plain names count.
                // (`a..b` index the arena for a decoded name, so only plain names are read.)
                if sorted {
                    sorted = tag == Tag::Plain && {
                        let key = NameKey::of(&self.s[a..b]);
                        let in_order = previous.is_none_or(|p| p <= key);
                        previous = Some(key);
                        in_order
                    };
                }
                values_verbatim &= self.tape[value].has(VERBATIM);
                tight &= member_tight & !self.ws();
                match self.s.get(self.i)? {
                    b',' => {
                        self.i += 1;
                        tight &= !self.ws();
                    }
                    b'}' => {
                        self.i += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        self.close(at, sorted && tight && values_verbatim);
        if sorted {
            self.tape[at].flags |= SORTED;
        }
        Some(())
    }

    /// Ends the array or object whose node is at `at`, now that its text has been read.
    fn close(&mut self, at: usize, verbatim: bool) {
        let after = self.tape.len();
        let node = &mut self.tape[at];
        node.b = after;
        node.end = self.i;
        if verbatim {
            node.flags |= VERBATIM;
        }
    }

    /// A string starting at its opening quote.
    fn string(&mut self) -> Option<()> {
        self.i += 1;
        let start = self.i;
        self.i += plain_run(self.s.get(self.i..)?);
        match self.s.get(self.i)? {
            b'"' => {
                let end = self.i;
                self.i += 1;
                self.node(Tag::Plain, VERBATIM, start, end);
                return Some(());
            }
            b'\\' => {}
            _ => return None,
        }
        // Escapes: decode into the arena.
        let from = self.arena.len();
        self.arena.extend_from_slice(&self.s[start..self.i]);
        self.i = decode_escaped(self.s, self.i, &mut self.arena)?;
        self.node(Tag::Decoded, 0, from, self.arena.len());
        Some(())
    }
}

pub(super) struct Writer<'a, const VERBATIM: bool> {
    s: &'a [u8],
    tape: &'a [Node],
    arena: &'a [u8],
    /// (name, name's tape index) of the members of the objects being written, innermost
    /// last; a member's value is the node after its name.
    members: Vec<(NameKey<'a>, usize)>,
}

/// A member name, ordered by its bytes, then by its [`name_head`] first.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct NameKey<'a> {
    head: u64,
    name: &'a [u8],
}

impl<'a> NameKey<'a> {
    fn of(name: &'a [u8]) -> Self {
        Self {
            head: name_head(name, 0, name.len()),
            name,
        }
    }
}

impl<'a, const COPY: bool> Writer<'a, COPY> {
    /// The tape index after the value at `at`.
    fn after(&self, at: usize) -> usize {
        match self.tape[at].tag {
            Tag::Array | Tag::Object => self.tape[at].b,
            _ => at + 1,
        }
    }

    /// The decoded bytes of the string at `at`.
    fn name(&self, at: usize) -> &'a [u8] {
        let Node { tag, a, b, .. } = self.tape[at];
        if tag == Tag::Decoded {
            &self.arena[a..b]
        } else {
            &self.s[a..b]
        }
    }

    /// Writes the value at tape index `at`.
    fn value<S: Sink>(&mut self, at: usize, out: &mut S) {
        let node = self.tape[at];
        if COPY && node.has(VERBATIM) {
            out.put(&self.s[node.start()..node.end]);
            return;
        }
        let Node { tag, a, b, .. } = node;
        match tag {
            Tag::Null => out.put(b"null"),
            Tag::True => out.put(b"true"),
            Tag::False => out.put(b"false"),
            Tag::Number => {
                let text = &self.s[a..b];
                match scan_number(text, 0) {
                    Some((number, end)) if end == text.len() => write_number(&number, out),
                    // Checked by the parser; keep the text should that ever be wrong.
                    _ => out.put(text),
                }
            }
            Tag::Plain => {
                out.put(b"\"");
                out.put(&self.s[a..b]);
                out.put(b"\"");
            }
            Tag::Decoded => write_string(&self.arena[a..b], out),
            Tag::Array => {
                out.put(b"[");
                let mut i = at + 1;
                while i < b {
                    if i > at + 1 {
                        out.put(b",");
                    }
                    self.value(i, out);
                    i = self.after(i);
                }
                out.put(b"]");
            }
            Tag::Object => {
                let base = self.members.len();
                let mut i = at + 1;
                while i < b {
                    self.members.push((NameKey::of(self.name(i)), i));
                    i = self.after(i + 1);
                }
                // By name, then by position: a stable sort without its buffer. Members
                // already in order as written stay as they are.
                if !(COPY && node.has(SORTED)) {
                    self.members[base..].sort_unstable();
                }
                out.put(b"{");
                for j in base..self.members.len() {
                    if j > base {
                        out.put(b",");
                    }
                    let (_, k) = self.members[j];
                    let (name, value) = (self.tape[k], self.tape[k + 1]);
                    if COPY && name.has(TIGHT) && name.has(VERBATIM) && value.has(VERBATIM) {
                        // `"name":value`, as written.
                        out.put(&self.s[name.start()..value.end]);
                        continue;
                    }
                    self.value(k, out);
                    out.put(b":");
                    self.value(k + 1, out);
                }
                self.members.truncate(base);
                out.put(b"}");
            }
        }
    }
}
