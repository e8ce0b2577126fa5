//! pprof files and bodies: gzip and protobuf decoded under a budget of what decoding keeps
//! in memory, and encoded back.
//!
//! Decoding a gzipped profile inflates it in 64 KiB chunks through the
//! [`footprint`](crate::footprint) scanner, keeping the chunks only while the protobuf
//! bytes plus the structures they will decode into fit the budget: a zip bomb or a message
//! built to expand in memory is refused having kept at most the budget, not the whole
//! inflated body nor its decoded form. prost then decodes from the kept chunks into tables
//! reserved to their exact sizes, freeing each chunk once read.

use std::io::{Read, Write as _};

use prost::Message as _;
use prost::bytes::Buf;

use crate::footprint::{Counts, Scanner};
use crate::pb::Profile;
use crate::{Error, Result};

/// Bounds on one decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest inflated size accepted, in bytes: bounds the time spent inflating.
    pub max_decompressed_bytes: u64,
    /// Most memory the decode may keep, in bytes: the protobuf bytes held while decoding
    /// (the inflated chunks, or a plain input itself) plus the decoded `Profile` and what
    /// validating it needs, counted as the allocator sizes them. A gzipped input is the
    /// caller's and not counted.
    pub max_kept_bytes: u64,
}

impl Default for DecodeLimits {
    /// 256 MiB each: far above real profiles (Go heap profiles are tens to hundreds of KiB
    /// gzipped, a few MiB decoded), so only hostile or broken input meets them.
    fn default() -> Self {
        DecodeLimits {
            max_decompressed_bytes: 256 << 20,
            max_kept_bytes: 256 << 20,
        }
    }
}

/// Inflated bytes read at a time.
const CHUNK: usize = 64 << 10;

/// Decodes a gzipped or plain pprof profile under [`DecodeLimits::default`], and validates it.
///
/// # Errors
/// As [`decode_with`].
pub fn decode(bytes: &[u8]) -> Result<Profile> {
    decode_with(bytes, &DecodeLimits::default())
}

/// Decodes a gzipped (gzip magic `1f 8b`, one or more members) or plain pprof profile
/// under `limits`, and [`validate`](crate::validate())s it.
///
/// The whole inflated size is judged before what it contains: a bomb is called a bomb even
/// when its bytes are not a protobuf.
///
/// # Errors
/// [`Error::Empty`]; [`Error::Gzip`] for a corrupt stream; [`Error::TooLargeDecompressed`];
/// [`Error::TooLargeDecoded`] when what decoding keeps would pass
/// [`DecodeLimits::max_kept_bytes`] (found before it is allocated); [`Error::Protobuf`];
/// [`Error::Invalid`].
pub fn decode_with(bytes: &[u8], limits: &DecodeLimits) -> Result<Profile> {
    if bytes.is_empty() {
        return Err(Error::Empty);
    }
    let profile = if bytes.starts_with(&[0x1f, 0x8b]) {
        let (chunks, counts) = inflate_and_scan(bytes, limits)?;
        let mut profile = reserved(&counts);
        profile
            .merge(chunks)
            .map_err(|e| Error::Protobuf(e.to_string()))?;
        profile
    } else {
        if bytes.len() as u64 > limits.max_decompressed_bytes {
            return Err(Error::TooLargeDecompressed {
                limit: limits.max_decompressed_bytes,
            });
        }
        // The caller holds the bytes while they decode: they count against the budget.
        let held = bytes.len() as u64;
        let mut scan = Scanner::new();
        for chunk in bytes.chunks(CHUNK) {
            scan.feed(chunk).map_err(Error::Protobuf)?;
            within_budget(held, scan.bytes_so_far(), limits)?;
        }
        let footprint = scan.finish().map_err(Error::Protobuf)?;
        within_budget(bytes.len() as u64, footprint.decoded_bytes, limits)?;
        let mut profile = reserved(&footprint.counts);
        profile
            .merge(bytes)
            .map_err(|e| Error::Protobuf(e.to_string()))?;
        profile
    };
    crate::validate(&profile)?;
    Ok(profile)
}

/// Inflates `gz` through the scanner; returns the inflated bytes and the table sizes.
fn inflate_and_scan(gz: &[u8], limits: &DecodeLimits) -> Result<(Chunks, Counts)> {
    let mut inflater = flate2::read::MultiGzDecoder::new(gz);
    let mut scan = Scanner::new();
    let mut kept = Chunks::default();
    let mut total = 0u64;
    // After a wire error the rest is inflated into one scratch buffer, only to measure it.
    let mut wire_error: Option<String> = None;
    let mut scratch = Vec::new();
    loop {
        let mut chunk = if wire_error.is_some() {
            std::mem::take(&mut scratch)
        } else {
            Vec::new()
        };
        chunk.resize(CHUNK, 0);
        let n = fill(&mut inflater, &mut chunk).map_err(|e| Error::Gzip(e.to_string()))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > limits.max_decompressed_bytes {
            return Err(Error::TooLargeDecompressed {
                limit: limits.max_decompressed_bytes,
            });
        }
        if wire_error.is_some() {
            scratch = chunk;
            continue;
        }
        chunk.truncate(n);
        if let Err(e) = scan.feed(&chunk) {
            wire_error = Some(e);
            kept = Chunks::default();
            scratch = chunk;
            continue;
        }
        kept.push(chunk);
        within_budget(kept.held, scan.bytes_so_far(), limits)?;
    }
    if let Some(e) = wire_error {
        return Err(Error::Protobuf(e));
    }
    let footprint = scan.finish().map_err(Error::Protobuf)?;
    within_budget(kept.held, footprint.decoded_bytes, limits)?;
    Ok((kept, footprint.counts))
}

/// Reads until `buf` is full or the stream ends; returns the bytes read.
fn fill(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn within_budget(protobuf: u64, decoded: u64, limits: &DecodeLimits) -> Result<()> {
    let needed = protobuf.saturating_add(decoded);
    if needed > limits.max_kept_bytes {
        return Err(Error::TooLargeDecoded {
            protobuf,
            decoded,
            needed,
            limit: limits.max_kept_bytes,
        });
    }
    Ok(())
}

/// An empty profile whose tables have room for exactly `counts`.
fn reserved(counts: &Counts) -> Profile {
    // Each count is bounded by the scanned bytes, which fit in memory.
    let n = |c: u64| usize::try_from(c).unwrap_or(0);
    Profile {
        sample_type: Vec::with_capacity(n(counts.sample_type)),
        sample: Vec::with_capacity(n(counts.sample)),
        mapping: Vec::with_capacity(n(counts.mapping)),
        location: Vec::with_capacity(n(counts.location)),
        function: Vec::with_capacity(n(counts.function)),
        string_table: Vec::with_capacity(n(counts.string_table)),
        comment: Vec::with_capacity(n(counts.comment)),
        ..Profile::default()
    }
}

/// Inflated bytes in chunks, read by prost as one buffer; a chunk is freed once read.
#[derive(Default)]
struct Chunks {
    chunks: Vec<Vec<u8>>,
    /// Index of the chunk being read, and the offset in it.
    at: (usize, usize),
    remaining: usize,
    /// Bytes allocated for the chunks.
    held: u64,
}

impl Chunks {
    fn push(&mut self, chunk: Vec<u8>) {
        self.remaining += chunk.len();
        self.held += chunk.capacity() as u64;
        self.chunks.push(chunk);
    }
}

impl Buf for Chunks {
    fn remaining(&self) -> usize {
        self.remaining
    }

    fn chunk(&self) -> &[u8] {
        self.chunks
            .get(self.at.0)
            .map_or(&[][..], |c| &c[self.at.1..])
    }

    fn advance(&mut self, mut cnt: usize) {
        while cnt > 0 {
            let Some(current) = self.chunks.get_mut(self.at.0) else {
                return;
            };
            let left = current.len() - self.at.1;
            if cnt < left {
                self.at.1 += cnt;
                self.remaining -= cnt;
                return;
            }
            cnt -= left;
            self.remaining -= left;
            *current = Vec::new();
            self.at = (self.at.0 + 1, 0);
        }
    }
}

/// Serializes and gzips a profile: the on-disk pprof format `go tool pprof` reads.
///
/// # Errors
/// [`Error::Encode`] if compression fails (it writes to memory, so it does not in practice).
pub fn encode_gzip(profile: &Profile) -> Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&profile.encode_to_vec())
        .and_then(|()| gz.finish())
        .map_err(Error::Encode)
}
