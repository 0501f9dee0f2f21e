//! The stored form of a response: status, the headers kept for replay, and the body.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 4] = b"IDR\x01";

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers kept for replay, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body.
    pub body: Bytes,
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
        let mut out = Vec::with_capacity(12 + headers_len + self.body.len());
        out.extend_from_slice(MAGIC);
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

    /// Decodes bytes written by [`StoredResponse::encode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut r = Reader { bytes, at: 0 };
        if r.take(4).ok() != Some(&MAGIC[..]) {
            return Err(DecodeError::UnknownFormat);
        }
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
        let rest = bytes.len() - r.at;
        if rest > 0 {
            return Err(DecodeError::TrailingBytes(rest));
        }
        Ok(Self {
            status,
            headers,
            body,
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
        };
        assert_eq!(StoredResponse::decode(&empty.encode()).unwrap(), empty);
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
