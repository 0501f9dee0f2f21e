//! The stored form of a response: status, the headers kept for replay, and the body.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

/// A response replayed as stored.
const MAGIC: &[u8; 4] = b"IDR\x01";
/// A completion whose response could not be kept: one more byte, why, after the magic.
const MAGIC_NOT_REPLAYABLE: &[u8; 4] = b"IDR\x02";

/// Why the handler's response was recorded without its body: the handler ran, so the key is
/// not free for a second execution, but there is no response to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NotReplayable {
    /// The body was larger than the layer's response limit.
    TooLarge,
    /// The body failed while the layer read it (after the handler had run).
    BodyFailed,
    /// The layer was told not to store the answer's status
    /// ([`IdempotencyLayer::store_status`](crate::IdempotencyLayer::store_status)), and the key
    /// was settled for good ([`OnUnstored::Settle`](crate::OnUnstored::Settle)).
    StatusNotStored,
}

impl NotReplayable {
    const fn code(self) -> u8 {
        match self {
            Self::TooLarge => 1,
            Self::BodyFailed => 2,
            Self::StatusNotStored => 3,
        }
    }

    const fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::TooLarge),
            2 => Some(Self::BodyFailed),
            3 => Some(Self::StatusNotStored),
            _ => None,
        }
    }

    /// A short label (`too_large`, `body_failed`, `status_not_stored`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::TooLarge => "too_large",
            Self::BodyFailed => "body_failed",
            Self::StatusNotStored => "status_not_stored",
        }
    }
}

/// Why stored bytes are not a response this crate wrote. Replaying such a record answers 500;
/// it never panics.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes do not start with this format's magic and version.
    #[error("not a stored response (unknown magic or version)")]
    UnknownFormat,
    /// The bytes end before the field at `offset`.
    #[error("stored response is truncated at byte {offset}")]
    Truncated {
        /// Where the missing field starts.
        offset: usize,
    },
    /// A not-replayable record names a reason this version does not know.
    #[error("stored response has an unknown not-replayable reason {0}")]
    UnknownReason(u8),
    /// The status code is out of range.
    #[error("stored response has an invalid status code {0}")]
    InvalidStatus(u16),
    /// A header name or value is not valid.
    #[error("stored response has an invalid header at byte {offset}")]
    InvalidHeader {
        /// Where the header starts.
        offset: usize,
    },
    /// Bytes follow the body.
    #[error("stored response has {0} trailing bytes")]
    TrailingBytes(usize),
}

/// A response as kept in the store: `IDR\x01`, status (u16 BE), header count (u16 BE), each
/// header as name length (u16 BE), name, value length (u32 BE), value, then body length
/// (u32 BE) and body.
///
/// A completion whose response could not be kept ([`StoredResponse::not_replayable`]) is
/// written `IDR\x02`, one byte for the reason (1 too large, 2 body failed), then the same
/// fields. A replayable response is always written `IDR\x01`, so a reader that knows only
/// that format still reads every replayable record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers kept for replay, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body.
    pub body: Bytes,
    /// `Some` when the handler ran but its response could not be kept: the status and
    /// headers are the handler's, and a replay answers a problem document instead of the body.
    pub not_replayable: Option<NotReplayable>,
}

impl StoredResponse {
    /// Encodes the response.
    ///
    /// Header values longer than `u32::MAX` cannot occur (`http` limits them far lower), and the
    /// body is capped by the layer's response limit, which is a `usize` checked against
    /// `u32::MAX` when the layer is configured.
    pub fn encode(&self) -> Vec<u8> {
        let headers_len: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.as_str().len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(13 + headers_len + self.body.len());
        match self.not_replayable {
            None => out.extend_from_slice(MAGIC),
            Some(why) => {
                out.extend_from_slice(MAGIC_NOT_REPLAYABLE);
                out.push(why.code());
            }
        }
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        let count = u16::try_from(self.headers.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&count.to_be_bytes());
        for (name, value) in self.headers.iter().take(usize::from(count)) {
            let name = name.as_str().as_bytes();
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&(self.body.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.body);
        out
    }

    /// Decodes bytes written by [`StoredResponse::encode`] (either version). Total: any bytes
    /// give a response or a [`DecodeError`], never a panic.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader { bytes, at: 0 };
        let not_replayable = match r.take(4) {
            Ok(m) if m == &MAGIC[..] => None,
            Ok(m) if m == &MAGIC_NOT_REPLAYABLE[..] => {
                let code = r.u8()?;
                Some(NotReplayable::from_code(code).ok_or(DecodeError::UnknownReason(code))?)
            }
            _ => return Err(DecodeError::UnknownFormat),
        };
        let code = r.u16()?;
        let status = StatusCode::from_u16(code).map_err(|_| DecodeError::InvalidStatus(code))?;
        let count = r.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let offset = r.at;
            let name_len = usize::from(r.u16()?);
            let name = HeaderName::from_bytes(r.take(name_len)?)
                .map_err(|_| DecodeError::InvalidHeader { offset })?;
            let value_len = r.u32()? as usize;
            let value = HeaderValue::from_bytes(r.take(value_len)?)
                .map_err(|_| DecodeError::InvalidHeader { offset })?;
            headers.push((name, value));
        }
        let body_len = r.u32()? as usize;
        let body = Bytes::copy_from_slice(r.take(body_len)?);
        let rest = bytes.len().saturating_sub(r.at);
        if rest > 0 {
            return Err(DecodeError::TrailingBytes(rest));
        }
        Ok(Self {
            status,
            headers,
            body,
            not_replayable,
        })
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or(DecodeError::Truncated { offset: self.at })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        let b = self.take(1)?;
        Ok(b[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredResponse {
        StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![
                (
                    HeaderName::from_static("content-type"),
                    HeaderValue::from_static("application/json"),
                ),
                (
                    HeaderName::from_static("location"),
                    HeaderValue::from_static("/books/1"),
                ),
                (
                    HeaderName::from_static("link"),
                    HeaderValue::from_bytes(b"</a>; rel=\"x\" \xe9").unwrap(),
                ),
            ],
            body: Bytes::from_static(br#"{"id":1}"#),
            not_replayable: None,
        }
    }

    #[test]
    fn round_trips() {
        let r = sample();
        assert_eq!(StoredResponse::decode(&r.encode()).unwrap(), r);
        let empty = StoredResponse {
            status: StatusCode::NO_CONTENT,
            headers: vec![],
            body: Bytes::new(),
            not_replayable: None,
        };
        assert_eq!(StoredResponse::decode(&empty.encode()).unwrap(), empty);
    }

    /// A replayable response is written in the first format, byte for byte: records stay
    /// readable by older versions, and records they wrote decode as before.
    #[test]
    fn replayable_responses_keep_the_first_format() {
        let bytes = sample().encode();
        assert_eq!(&bytes[..4], b"IDR\x01");
        let mut expected = b"IDR\x01\x00\xc9\x00\x03".to_vec();
        for (n, v) in &sample().headers {
            expected.extend_from_slice(&(n.as_str().len() as u16).to_be_bytes());
            expected.extend_from_slice(n.as_str().as_bytes());
            expected.extend_from_slice(&(v.len() as u32).to_be_bytes());
            expected.extend_from_slice(v.as_bytes());
        }
        expected.extend_from_slice(&8u32.to_be_bytes());
        expected.extend_from_slice(br#"{"id":1}"#);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn not_replayable_records_round_trip_and_unknown_reasons_are_errors() {
        for why in [
            NotReplayable::TooLarge,
            NotReplayable::BodyFailed,
            NotReplayable::StatusNotStored,
        ] {
            let r = StoredResponse {
                body: Bytes::new(),
                not_replayable: Some(why),
                ..sample()
            };
            let bytes = r.encode();
            assert_eq!(&bytes[..5], &[b'I', b'D', b'R', 2, why.code()]);
            assert_eq!(StoredResponse::decode(&bytes).unwrap(), r);
            for n in 0..bytes.len() {
                assert!(StoredResponse::decode(&bytes[..n]).is_err(), "prefix {n}");
            }
        }
        for code in [0u8, 4, 0xff] {
            let mut bytes = StoredResponse {
                not_replayable: Some(NotReplayable::TooLarge),
                ..sample()
            }
            .encode();
            bytes[4] = code;
            assert_eq!(
                StoredResponse::decode(&bytes),
                Err(DecodeError::UnknownReason(code))
            );
        }
        assert_eq!(
            StoredResponse::decode(b"IDR\x03\x01"),
            Err(DecodeError::UnknownFormat)
        );
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error_not_a_panic() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(StoredResponse::decode(&bytes[..n]).is_err(), "prefix {n}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(
            StoredResponse::decode(&longer),
            Err(DecodeError::TrailingBytes(1))
        );
        // Flip every byte to every value: never a panic, and a wrong magic is refused.
        for i in 0..bytes.len() {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = bytes.clone();
                b[i] = v;
                let _ = StoredResponse::decode(&b);
            }
        }
        assert_eq!(
            StoredResponse::decode(b"{\"json\":true}"),
            Err(DecodeError::UnknownFormat)
        );
        let mut bad_status = bytes.clone();
        bad_status[4..6].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(
            StoredResponse::decode(&bad_status),
            Err(DecodeError::InvalidStatus(1000))
        );
        let mut huge_len = bytes;
        let last = huge_len.len() - 12;
        huge_len[last..last + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(StoredResponse::decode(&huge_len).is_err());
    }
}
