//! What decoding a `Profile` will keep in memory, read from its wire bytes before any of
//! them is decoded.
//!
//! prost decodes straight into `Vec`s and `String`s and bounds none of them: the input's
//! length bounds only how many bytes it reads. The structures are several times larger
//! than their encoding, and nothing stops a hostile encoder from choosing the worst ratio:
//! an empty `Sample` is 2 bytes on the wire and 72 bytes of `Sample` in memory; each
//! one-element `location_id` adds 3 bytes on the wire and a 32-byte allocation. So a
//! streaming [`Scanner`] walks the wire format first (no allocation, any chunking of the
//! input) and counts what prost will allocate, as the allocator will size it; the caller
//! refuses the input when that passes its budget, before decoding it.
//!
//! The scanner also refuses what prost would mishandle: groups (wire types 3 and 4, unused
//! by pprof) are skipped by prost recursively, and `pprof_util` (under `jemalloc_pprof`)
//! turns prost's recursion limit off for the whole build, so a few KiB of nested groups
//! would overflow the decoding thread's stack.

use std::mem::size_of;

use crate::pb;

/// How many of each repeated top-level field the profile has, so the decoder can reserve
/// them exactly (prost pushes one at a time, which would double capacities).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// `sample_type` entries.
    pub sample_type: u64,
    /// `sample` entries.
    pub sample: u64,
    /// `mapping` entries.
    pub mapping: u64,
    /// `location` entries.
    pub location: u64,
    /// `function` entries.
    pub function: u64,
    /// `string_table` entries.
    pub string_table: u64,
    /// `comment` entries.
    pub comment: u64,
}

/// The result of a scan: the table sizes and the bytes decoding will keep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Table sizes.
    pub counts: Counts,
    /// Bytes of the decoded `Profile` and of what validating it allocates, counted as the
    /// allocator sizes them (an upper bound for glibc's and jemalloc's size classes).
    pub decoded_bytes: u64,
}

/// Bytes the allocator hands out for a request of `n` bytes: glibc adds an 8-byte header
/// and rounds to 16 with a 32-byte minimum; jemalloc's size classes round up by less than
/// a quarter. Zero-byte requests allocate nothing.
pub fn allocation(n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    (n + n / 4 + 8).next_multiple_of(16).max(32)
}

/// Capacity a `Vec` reaches when `n` elements are pushed one by one: the first push
/// reserves 4, then it doubles (std's growth for elements of 1 KiB or less).
fn pushed(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        n.next_power_of_two().max(4)
    }
}

/// Bytes held by a `String` decoded from `len` bytes (prost reserves exactly `len`, which
/// std rounds up to 8 for a fresh buffer).
fn string_bytes(len: u64) -> u64 {
    if len == 0 { 0 } else { allocation(len.max(8)) }
}

/// What the bytes of a length-delimited field decode into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Profile,
    Sample,
    Location,
    /// `ValueType`, `Mapping`, `Function`, `Line`, `Label`: scalar fields only.
    Leaf,
    /// A packed run of varints of a repeated scalar field.
    Packed(Scalars),
}

/// The repeated scalar fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scalars {
    LocationId,
    Value,
    Comment,
}

/// An open length-delimited region.
#[derive(Debug, Clone, Copy)]
struct Open {
    kind: Kind,
    /// Stream offset where it ends.
    end: u64,
    /// Per kind: a sample's location IDs, values and labels; a location's lines.
    n: [u64; 3],
}

/// What the next bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    /// A field key; inside a packed run, the next element.
    Key,
    /// The varint value of a scalar field; `Some` counts an element of a repeated one.
    Value(Option<Scalars>),
    /// The length of a length-delimited field, what its bytes are, and its number.
    Len(Field, u64),
    /// Bytes to pass over (string contents, unknown fields, fixed-width values).
    Skip(u64),
}

/// What a length-delimited field holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Message(Kind),
    String,
    Unknown,
}

/// A streaming scan of an encoded `perftools.profiles.Profile`: [`Scanner::feed`] it the
/// bytes in any chunks, then [`Scanner::finish`].
#[derive(Debug)]
pub struct Scanner {
    stack: Vec<Open>,
    need: Need,
    /// The varint being read: value, shift, bytes so far.
    varint: (u64, u32, u8),
    pos: u64,
    counts: Counts,
    bytes: u64,
}

impl Default for Scanner {
    fn default() -> Self {
        Self::new()
    }
}

impl Scanner {
    /// A scan at the start of a message.
    pub fn new() -> Self {
        Scanner {
            stack: vec![Open {
                kind: Kind::Profile,
                end: u64::MAX,
                n: [0; 3],
            }],
            need: Need::Key,
            varint: (0, 0, 0),
            pos: 0,
            counts: Counts::default(),
            bytes: 0,
        }
    }

    /// Bytes decoding will keep for what was scanned so far (grows monotonically; the
    /// final figure is [`Footprint::decoded_bytes`]).
    pub fn bytes_so_far(&self) -> u64 {
        self.bytes
    }

    /// Scans the next `data`.
    ///
    /// # Errors
    /// Why the bytes are not a `Profile` prost would decode within the scan's accounting.
    pub fn feed(&mut self, data: &[u8]) -> Result<(), String> {
        let mut i = 0;
        while i < data.len() {
            if self.need == Need::Key && self.varint.2 == 0 {
                self.close_ended()?;
            }
            if let Need::Skip(n) = self.need {
                let k = usize::try_from(n).unwrap_or(usize::MAX).min(data.len() - i);
                i += k;
                self.pos += k as u64;
                let left = n - k as u64;
                self.need = if left == 0 {
                    Need::Key
                } else {
                    Need::Skip(left)
                };
                continue;
            }
            let b = data[i];
            i += 1;
            self.pos += 1;
            if self.pos > self.top().end {
                return Err(format!(
                    "a varint at byte {} runs past the end of its message",
                    self.pos - 1
                ));
            }
            let (value, shift, len) = &mut self.varint;
            if *len == 9 && b > 1 {
                return Err(format!("invalid varint ending at byte {}", self.pos - 1));
            }
            *value |= u64::from(b & 0x7f) << *shift;
            *shift += 7;
            *len += 1;
            if b & 0x80 == 0 {
                let v = *value;
                self.varint = (0, 0, 0);
                self.token(v)?;
            }
        }
        Ok(())
    }

    /// Ends the scan.
    ///
    /// # Errors
    /// When the input ended inside a field or a nested message.
    pub fn finish(mut self) -> Result<Footprint, String> {
        if self.need == Need::Key && self.varint.2 == 0 {
            self.close_ended()?;
        }
        if self.need != Need::Key || self.varint.2 != 0 || self.stack.len() != 1 {
            return Err(format!(
                "the input ends inside a field or nested message (at byte {})",
                self.pos
            ));
        }
        let c = self.counts;
        // The tables are reserved exactly; one allocation each on top of the elements
        // already counted.
        let tables = [
            (c.sample_type, size_of::<pb::ValueType>()),
            (c.sample, size_of::<pb::Sample>()),
            (c.mapping, size_of::<pb::Mapping>()),
            (c.location, size_of::<pb::Location>()),
            (c.function, size_of::<pb::Function>()),
            (c.string_table, size_of::<String>()),
            (c.comment, size_of::<i64>()),
        ];
        let overhead: u64 = tables
            .iter()
            .map(|&(n, size)| allocation(n * size as u64) - n * size as u64)
            .sum();
        Ok(Footprint {
            counts: c,
            decoded_bytes: self.bytes + overhead,
        })
    }

    fn top(&self) -> &Open {
        // The Profile frame is never popped.
        &self.stack[self.stack.len() - 1]
    }

    fn top_mut(&mut self) -> &mut Open {
        let last = self.stack.len() - 1;
        &mut self.stack[last]
    }

    /// Pops the regions that end here, adding what their vectors hold.
    fn close_ended(&mut self) -> Result<(), String> {
        while self.stack.len() > 1 && self.top().end == self.pos {
            let Some(open) = self.stack.pop() else { break };
            self.bytes += match open.kind {
                Kind::Sample => {
                    allocation(pushed(open.n[0]) * 8)
                        + allocation(pushed(open.n[1]) * 8)
                        + allocation(pushed(open.n[2]) * size_of::<pb::Label>() as u64)
                }
                Kind::Location => allocation(pushed(open.n[0]) * size_of::<pb::Line>() as u64),
                Kind::Profile | Kind::Leaf | Kind::Packed(_) => 0,
            };
        }
        Ok(())
    }

    fn token(&mut self, v: u64) -> Result<(), String> {
        match self.need {
            Need::Key => {
                if let Kind::Packed(scalars) = self.top().kind {
                    self.count_scalar(scalars);
                    return Ok(());
                }
                self.key(v)
            }
            Need::Value(scalars) => {
                if let Some(s) = scalars {
                    self.count_scalar(s);
                }
                self.need = Need::Key;
                Ok(())
            }
            Need::Len(field, number) => self.len(field, number, v),
            Need::Skip(_) => Ok(()),
        }
    }

    fn key(&mut self, key: u64) -> Result<(), String> {
        let number = key >> 3;
        let at = self.pos;
        if number == 0 || number > (1 << 29) - 1 {
            return Err(format!("invalid field number {number} at byte {at}"));
        }
        let kind = self.top().kind;
        let (scalars, message) = schema(kind, number);
        self.need = match key & 7 {
            0 if message.is_some() => {
                return Err(format!(
                    "field {number} of {kind:?} at byte {at} is a varint, expected a message"
                ));
            }
            0 => Need::Value(scalars),
            1 => Need::Skip(8),
            5 => Need::Skip(4),
            2 => Need::Len(
                match (message, scalars) {
                    (Some(field), _) => field,
                    (None, Some(s)) => Field::Message(Kind::Packed(s)),
                    (None, None) => Field::Unknown,
                },
                number,
            ),
            3 | 4 => {
                return Err(format!(
                    "a group (wire type {}) at byte {at}: pprof does not use groups",
                    key & 7
                ));
            }
            w => return Err(format!("invalid wire type {w} at byte {at}")),
        };
        Ok(())
    }

    fn len(&mut self, field: Field, number: u64, len: u64) -> Result<(), String> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.top().end)
            .ok_or_else(|| {
                format!(
                    "a field of {len} bytes at byte {} runs past the end of its message",
                    self.pos
                )
            })?;
        self.need = Need::Key;
        match field {
            Field::Message(kind) => {
                self.count_message(number);
                self.stack.push(Open {
                    kind,
                    end,
                    n: [0; 3],
                });
            }
            Field::String => {
                self.counts.string_table += 1;
                self.bytes += size_of::<String>() as u64 + string_bytes(len);
                if len > 0 {
                    self.need = Need::Skip(len);
                }
            }
            Field::Unknown => {
                if len > 0 {
                    self.need = Need::Skip(len);
                }
            }
        }
        Ok(())
    }

    /// Message field `number` of the current message starts (before it is pushed).
    fn count_message(&mut self, number: u64) {
        // Validation sorts the IDs of these tables when they are not 1..=n (8 bytes each).
        let id = 8;
        let (counter, size) = match (self.top().kind, number) {
            (Kind::Profile, 1) => (&mut self.counts.sample_type, size_of::<pb::ValueType>()),
            (Kind::Profile, 2) => (&mut self.counts.sample, size_of::<pb::Sample>()),
            (Kind::Profile, 3) => (&mut self.counts.mapping, size_of::<pb::Mapping>() + id),
            (Kind::Profile, 4) => (&mut self.counts.location, size_of::<pb::Location>() + id),
            (Kind::Profile, 5) => (&mut self.counts.function, size_of::<pb::Function>() + id),
            (Kind::Sample, 3) => {
                self.top_mut().n[2] += 1;
                return;
            }
            (Kind::Location, 4) => {
                self.top_mut().n[0] += 1;
                return;
            }
            _ => return,
        };
        *counter += 1;
        self.bytes += size as u64;
    }

    /// An element of a repeated scalar field, packed (the region is on top of its message)
    /// or not.
    fn count_scalar(&mut self, s: Scalars) {
        let last = self.stack.len() - 1;
        let message = if matches!(self.stack[last].kind, Kind::Packed(_)) {
            last - 1
        } else {
            last
        };
        match s {
            Scalars::LocationId => self.stack[message].n[0] += 1,
            Scalars::Value => self.stack[message].n[1] += 1,
            Scalars::Comment => {
                self.counts.comment += 1;
                self.bytes += 8;
            }
        }
    }
}

/// For field `number` of a message of `kind`: the repeated scalar field it is (counted,
/// packed or not), and what it holds when it is length-delimited.
fn schema(kind: Kind, number: u64) -> (Option<Scalars>, Option<Field>) {
    match (kind, number) {
        (Kind::Profile, 1 | 3 | 5 | 11) => (None, Some(Field::Message(Kind::Leaf))),
        (Kind::Profile, 2) => (None, Some(Field::Message(Kind::Sample))),
        (Kind::Profile, 4) => (None, Some(Field::Message(Kind::Location))),
        (Kind::Profile, 6) => (None, Some(Field::String)),
        (Kind::Profile, 13) => (Some(Scalars::Comment), None),
        (Kind::Sample, 1) => (Some(Scalars::LocationId), None),
        (Kind::Sample, 2) => (Some(Scalars::Value), None),
        (Kind::Sample, 3) | (Kind::Location, 4) => (None, Some(Field::Message(Kind::Leaf))),
        _ => (None, None),
    }
}
